"""Runtime lines: the catalog of vLLM lines dspark can run, the line a node's state names, and the
overlay (the Spark patch series) applied to a line's vLLM tree."""
