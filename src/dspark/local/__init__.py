"""The local appliance: the two-node (or N-node) pair on one machine, its tiny model and its
vision variant."""
