"""GPU plumbing that knows no operation: host slots, streams, IPC, kernels, launches, buffer layout."""
