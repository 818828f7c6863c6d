"""What a job costs, before it runs: the workload a job config describes (`workload.Workload`) and
the published formulas (Megatron, PaLM, Korthikanti, ZeRO, Young/Daly, bubbles) that the strategies
and the planner apply to it."""
