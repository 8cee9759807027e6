"""nsa_inductor: a torch.compile backend (``nsa_rocm``) for the DeepSeek Sparse Attention lightning indexer."""
