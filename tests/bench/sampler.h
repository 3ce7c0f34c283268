/*
 * A sampling profile of a benchmark's own phases, for hosts where no profiler is
 * installed (a GPU host with nothing but its driver).
 *
 * With EMBER_BENCH_PROFILE=DIR in the environment, bench_profile_begin(label) starts
 * sampling the calling thread every millisecond of wall time (its call stack, whether it
 * runs or waits) under that label, and bench_profile_end() stops sampling: between
 * phases no signal arrives, so the program's sleeps and waits there run as without the
 * variable. At exit the samples go to DIR/<program>-<pid>.profile, the stacks as offsets into
 * the objects they fell in, so that tests/bench/profile-report.py reads them against
 * the same binaries on another machine. Without the variable both calls do nothing.
 * One phase at a time, begun and ended on one thread; a phase begun on another thread
 * samples that one from then on.
 */
#ifndef EMBER_TESTS_BENCH_SAMPLER_H
#define EMBER_TESTS_BENCH_SAMPLER_H

void bench_profile_begin(const char *label);
void bench_profile_end(void);

#endif
