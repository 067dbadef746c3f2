"""The PyTorch DDP communication hook and its bookkeeping (buckets, names,
unused parameters)."""
