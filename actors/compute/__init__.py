"""The compute actors: the owners of the weights, the KV cache and the math."""
