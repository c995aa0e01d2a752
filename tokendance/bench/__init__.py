"""Benchmarks as a library: closed/open-loop simulations of a workload in several reuse modes side
by side (`simulation`), the capacity search (`capacity`), an HTTP driver for any OpenAI-compatible
server (`target`), tables and plots (`report`); `tokendance bench` is the command line."""
