"""The low-latency (decode) path: DeepEP's low_latency_dispatch and low_latency_combine."""
