"""Collectives (chapter 01), rank side: ``reference`` holds the inputs each rank starts from and, computed in
one process, what every rank must hold after each collective of torch.distributed."""
