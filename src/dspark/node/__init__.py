"""One node at run time: the supervisor and its pure policy, the vLLM process and its launch,
probes, liveness, the agent, signals, sd_notify, the host's hardware, RDMA and memory."""
