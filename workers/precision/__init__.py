"""Numerics of reduced precision (chapter 08), rank side: ``numerics`` holds the measurements that need no
communication (fp16 gradient underflow and loss scaling, bf16 updates lost without fp32 master weights)."""
