"""Two-level reduction for clusters of multi-GPU nodes: dense inside a node
(shared memory or the process group), the sparse exchange between nodes only
(docs/hierarchical.md)."""
