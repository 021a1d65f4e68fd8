"""Module-level helpers for the torchrl tests (spawned workers import them by name)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


class VersionNet(nn.Module):
    """A policy whose parameters all hold one number: the version the trainer wrote.

    Its forward reads every parameter, one at a time, and reports the smallest and the
    largest value it saw (``lo``, ``hi``): a forward that ran across a weight update sees
    two versions, ``lo != hi``. The action is CartPole's "push left" (one-hot).
    """

    def __init__(self, n: int = 32, width: int = 8) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(width)) for _ in range(n)])

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lo = torch.stack([p.min() for p in self.ps]).min()
        hi = torch.stack([p.max() for p in self.ps]).max()
        batch = observation.shape[:-1]
        action = torch.zeros(*batch, 2)
        action[..., 0] = 1
        return action, lo.expand(*batch, 1).clone(), hi.expand(*batch, 1).clone()


def version_policy() -> Any:
    from tensordict.nn import TensorDictModule

    return TensorDictModule(VersionNet(), in_keys=["observation"], out_keys=["action", "lo", "hi"])


def set_version(policy: nn.Module, version: int) -> None:
    with torch.no_grad():
        for p in policy.parameters():
            p.fill_(float(version))


def make_env() -> Any:
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def held_worker(scheme: Any, conn: Any, worker_idx: int) -> None:
    """A worker process driven the way torchrl's runner drives a scheme, plus commands.

    Commands (over *conn*): ``hold`` (keep the version: answers ``held``), ``release``,
    ``receive_held`` (``receive()`` from inside a hold), ``state`` (version, statistics,
    parameter values), ``repoint`` (point the scheme at a copy of the policy, as the
    runner does when it moved the policy), ``shutdown`` (twice), ``exit``.
    """
    model = VersionNet(n=4)
    scheme.init_on_receiver(model_id="policy", model=model, worker_idx=worker_idx)
    scheme.connect(worker_idx=worker_idx)
    held = None
    target: nn.Module = model
    conn.send("connected")
    while True:
        cmd = conn.recv()
        if cmd == "hold":
            held = scheme.hold()
            held.__enter__()
            conn.send("held")
        elif cmd == "release":
            assert held is not None
            held.__exit__(None, None, None)
            held = None
            conn.send("released")
        elif cmd == "receive_held":
            with scheme.hold():
                before = [float(p[0].detach()) for p in target.parameters()]
                got = scheme.receive(timeout=0.0)
                after = [float(p[0].detach()) for p in target.parameters()]
            conn.send((got, before == after))
        elif cmd == "state":
            stats = scheme.statistics()
            with torch.no_grad():
                _, lo, hi = target(torch.zeros(4))
            conn.send((scheme.version, stats.updates, stats.skipped, float(lo), float(hi)))
        elif cmd == "repoint":
            target = copy.deepcopy(model)
            scheme.model = target
            conn.send("repointed")
        elif cmd == "shutdown":
            scheme.shutdown()
            scheme.shutdown()  # idempotent
            conn.send(("closed", [float(p[0].detach()) for p in target.parameters()]))
        elif cmd == "exit":
            conn.send("bye")
            return
