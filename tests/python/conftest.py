"""A real emberd for the Python tests: started on ephemeral loopback ports from the
binary named by the EMBERD environment variable (meson sets it), with the admin token
below, stopped with SIGTERM at the end of the module that asked for it."""
import json
import os
import signal
import subprocess
import tempfile
import time

import pytest

ADMIN_TOKEN = "python-test-admin-token"


class Daemon:
    def __init__(self, tables=(), extra=None, data_token=None):
        self.directory = tempfile.mkdtemp(prefix="ember-python-")
        config = {
            "listen": {"data": "127.0.0.1:0", "admin": "127.0.0.1:0", "metrics": ""},
            "backend": {"type": "cpu", "threads": 2, "memory_limit_bytes": 1 << 30,
                        "initial_bytes": 16 << 20, "growth_bytes": 64 << 20},
            "admin_token": {"value": ADMIN_TOKEN},
            "tables": list(tables),
            "log_level": "info",
            "drain_timeout_ms": 5000,
        }
        if data_token is not None:
            config["data_token"] = {"value": data_token}
        config.update(extra or {})
        self.config_path = os.path.join(self.directory, "emberd.json")
        with open(self.config_path, "w") as handle:
            json.dump(config, handle)
        self.listen_path = os.path.join(self.directory, "listen.json")
        self.log = open(os.path.join(self.directory, "emberd.log"), "w")
        emberd = os.environ.get("EMBERD")
        if not emberd:
            pytest.skip("EMBERD is not set (run through meson test)")
        self.process = subprocess.Popen(
            [emberd, "--config", self.config_path, "--listen-file", self.listen_path],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not (os.path.exists(self.listen_path) and os.path.getsize(self.listen_path)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"emberd did not start: see {self.log.name}")
            time.sleep(0.02)
        time.sleep(0.02)
        with open(self.listen_path) as handle:
            listen = json.load(handle)
        self.data = listen["data"]
        self.admin = listen["admin"]

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def client(self, **options):
        import ember
        return ember.Client(self.data, admin=self.admin, admin_token=ADMIN_TOKEN, **options)


@pytest.fixture
def start_daemon():
    """A factory: start_daemon(tables=[...], extra={...}) -> Daemon, stopped afterwards."""
    started = []

    def start(**options):
        daemon = Daemon(**options)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


def table(name, dim=8, capacity=100000, optimizer=None, **fields):
    config = {"name": name, "dim": dim, "capacity": capacity,
              "optimizer": optimizer or {"type": "sgd", "lr": 0.1},
              "initializer": {"type": "uniform", "bound": 0.05, "seed": 3}}
    config.update(fields)
    return config
