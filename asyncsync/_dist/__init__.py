"""The multi-host transport: the control plane, the torch.distributed data plane, the trainer's host table, the relay, the distributed scheme.

It may import every lower layer, :mod:`asyncsync._local` included: a relay fans a transfer out
to its host's workers through the local sender, and the distributed scheme reuses the local
receiver. Nothing below imports from here.
"""
