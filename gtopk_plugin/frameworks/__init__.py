"""Per-framework layers: the only modules that import a training framework.
torch.distributed ships with torch, so its layer is imported eagerly; Horovod,
BytePS and TensorFlow layers are imported on demand."""
