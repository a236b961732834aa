"""What dspark knows of vLLM, the engine it runs: its facts, its log lines, its metrics text and a
pure model of its CUDA-graph dispatch. (Named `engine`, not `vllm`, so that nothing shadows the
vLLM package.)"""
