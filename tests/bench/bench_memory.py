#!/usr/bin/python3
"""emberd's resident memory under clients that never read their answers.

    bench_memory.py EMBERD [EMBERD ...] [--clients 8] [--pulls 400] [--rows 256]
                    [--seconds 3] [--config-limits JSON]

For each emberd binary given (for example one before and one after a change), in the
same run: start it on loopback with a table of dim 1024 and the limits below, open
CLIENTS connections that each pipeline PULLS pooled pulls of ROWS empty rows (about
4 bytes per row asked, 4 KiB per row answered) and never read, then sample the daemon's
RSS for SECONDS and print a table: RSS before the load, the peak during it, and the
growth, next to the answer bytes the clients asked for. Limits are the daemon's
"limits" object (keys a binary does not know are dropped for it, so older binaries run
with what they understand).
"""
import argparse
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

MIB = 1024 * 1024
DIM = 1024


def varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def field_varint(number, value):
    return varint(number << 3) + varint(value)


def field_bytes(number, data):
    return varint(number << 3 | 2) + varint(len(data)) + data


def pooled_pull(correlation, rows):
    """A PULL frame of rows empty rows pooled with SUM on table t."""
    meta = field_varint(1, correlation) + field_varint(2, 1)
    body = field_bytes(1, b"t") + field_varint(2, rows) + field_varint(4, 1)
    offsets = b"\0" * (4 * (rows + 1))
    attachment = offsets + b"\0" * ((-len(offsets)) % 8)
    header = b"EMB1" + struct.pack("<IQQ", len(meta), len(body), len(attachment))
    return header + meta + body + attachment


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def known_limits(emberd, limits, directory):
    """The limits this binary accepts: keys it refuses are dropped one by one."""
    limits = dict(limits)
    while True:
        config = write_config(directory, limits)
        check = subprocess.run([emberd, "--check-config", "--config", config],
                               capture_output=True, text=True)
        if check.returncode == 0:
            return limits
        dropped = [key for key in limits if f"limits.{key}" in check.stderr]
        if not dropped:
            sys.exit(f"{emberd}: configuration refused: {check.stderr.strip()}")
        for key in dropped:
            del limits[key]


def write_config(directory, limits):
    config = {
        "listen": {"data": "127.0.0.1:0", "admin": "127.0.0.1:0", "metrics": ""},
        "backend": {"type": "cpu", "threads": 2},
        "limits": limits,
        "tables": [{"name": "t", "dim": DIM, "capacity": 4096}],
        "admin_token": {"value": "bench-memory-token"},
        "log_level": "warning",
    }
    path = os.path.join(directory, "emberd.json")
    with open(path, "w") as out:
        json.dump(config, out)
    return path


def run_one(emberd, limits, options):
    with tempfile.TemporaryDirectory(prefix="ember-bench-memory-") as directory:
        limits = known_limits(emberd, limits, directory)
        config = write_config(directory, limits)
        listen = os.path.join(directory, "listen.json")
        log = open(os.path.join(directory, "emberd.log"), "w")
        daemon = subprocess.Popen([emberd, "--config", config, "--listen-file", listen],
                                  stdout=log, stderr=log)
        try:
            for _ in range(500):
                if os.path.exists(listen) and os.path.getsize(listen) > 0:
                    break
                time.sleep(0.01)
            with open(listen) as handle:
                host, port = json.load(handle)["data"].rsplit(":", 1)
            time.sleep(0.2)
            before = rss_bytes(daemon.pid)
            frame = pooled_pull(1, options.rows)
            sockets = []
            asked = 0
            for _ in range(options.clients):
                sock = socket.create_connection((host, int(port)))
                sock.setblocking(False)
                for _ in range(options.pulls):
                    try:
                        sent = sock.send(frame)
                    except BlockingIOError:
                        break
                    if sent < len(frame):
                        break
                    asked += options.rows * DIM * 4
                sockets.append(sock)
            peak = before
            end = time.monotonic() + options.seconds
            while time.monotonic() < end:
                peak = max(peak, rss_bytes(daemon.pid))
                time.sleep(0.05)
            for sock in sockets:
                sock.close()
            return limits, before, peak, asked
        finally:
            daemon.send_signal(signal.SIGKILL)
            daemon.wait()
            log.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("emberd", nargs="+")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--pulls", type=int, default=400)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--config-limits", default=json.dumps({
        "connection_inflight_bytes": 4 * MIB, "memory_bytes": 64 * MIB,
        "write_timeout_ms": 60000}))
    options = parser.parse_args()
    limits = json.loads(options.config_limits)
    print(f"command: bench_memory.py {' '.join(options.emberd)} --clients {options.clients} "
          f"--pulls {options.pulls} --rows {options.rows} --seconds {options.seconds}")
    print(f"load: {options.clients} clients x up to {options.pulls} pipelined pooled pulls of "
          f"{options.rows} empty rows (dim {DIM}: {options.rows * DIM * 4 // 1024} KiB answered "
          f"per pull), never read\n")
    print(f"{'emberd':40} {'limits applied':44} {'asked MiB':>10} {'RSS before':>11} "
          f"{'RSS peak':>9} {'growth MiB':>11}")
    for emberd in options.emberd:
        applied, before, peak, asked = run_one(emberd, limits, options)
        shown = ",".join(f"{key}={value}" for key, value in applied.items())
        print(f"{emberd[-40:]:40} {shown[:44]:44} {asked / MIB:10.0f} {before / MIB:11.1f} "
              f"{peak / MIB:9.1f} {(peak - before) / MIB:11.1f}")


if __name__ == "__main__":
    main()
