"""Performance model of speculative rollouts: step-time cost model and hardware profiles."""
