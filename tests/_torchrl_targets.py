"""Module-level helpers for the torchrl tests (spawned workers import them by name)."""

from __future__ import annotations

import copy
import logging
import threading
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


class ValueNet(nn.Module):
    """Acts ``param + buf`` whatever it observes: a batch shows the weights its worker ran."""

    def __init__(self, param: float = 0.0, buf: float = 0.0) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.full((1,), param))
        self.register_buffer("buf", torch.full((1,), buf))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (self.param + self.buf).expand(*observation.shape[:-1], 1).clone()


def value_policy(param: float = 0.0, buf: float = 0.0) -> Any:
    from tensordict.nn import TensorDictModule

    return TensorDictModule(ValueNet(param, buf), in_keys=["observation"], out_keys=["action"])


def random_value_policy() -> Any:
    """A policy factory whose every call acts another value."""
    return value_policy(float(torch.rand(()) * 1000))


def unpicklable_value_policy(param: float) -> Any:
    """A trainer-side policy that cannot travel to a worker (it holds a lock)."""
    policy = value_policy(param)
    policy.lock = threading.Lock()
    return policy


def value_weights(param: float, buf: float = 0.0) -> Any:
    """Weights for a :func:`value_policy`, as ``TensorDict.from_module`` lays them out."""
    from tensordict import TensorDict

    return TensorDict({"module": {"param": torch.full((1,), param), "buf": torch.full((1,), buf)}})


def make_const_env() -> Any:
    """A torchrl environment that observes zeros forever (no gymnasium needed)."""
    from tensordict import TensorDict
    from torchrl.data import Composite, Unbounded
    from torchrl.envs import EnvBase

    class ConstEnv(EnvBase):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(batch_size=())
            self.observation_spec = Composite(observation=Unbounded(shape=(2,)))
            self.action_spec = Unbounded(shape=(1,))
            self.reward_spec = Unbounded(shape=(1,))

        def _reset(self, tensordict: Any = None) -> Any:
            return TensorDict({"observation": torch.zeros(2)}, [])

        def _step(self, tensordict: Any) -> Any:
            return TensorDict({"observation": torch.zeros(2), "reward": torch.zeros(1), **self.full_done_spec.zero()}, [])

        def _set_seed(self, seed: int | None) -> None:
            pass

    return ConstEnv()


def held_worker(scheme: Any, conn: Any, worker_idx: int) -> None:
    """A worker process driven the way torchrl's runner drives a scheme, plus commands.

    Commands (over *conn*): ``hold`` (keep the version: answers ``held``), ``release``,
    ``receive_held`` (``receive()`` from inside a hold), ``state`` (version, statistics,
    parameter values), ``repoint`` (point the scheme at a copy of the policy, as the
    runner does when it moved the policy), ``wrap`` (point it at a module that calls the
    policy), ``swap_inner`` (that module now calls a copy), ``assign`` (the policy it calls
    gets new parameter tensors: ``load_state_dict(..., assign=True)``), ``reshape`` (one of
    them takes another shape), ``repoint_held`` (``repoint`` inside a hold: answers the
    error's type), ``shutdown`` (twice), ``exit``.
    """
    logging.getLogger("asyncsync").addHandler(logging.NullHandler())  # what a test expects reaches the trainer
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
        elif cmd == "wrap":
            target = nn.Sequential(model)
            scheme.model = target
            conn.send("wrapped")
        elif cmd == "swap_inner":
            target[0] = copy.deepcopy(target[0])
            conn.send("swapped")
        elif cmd == "assign":
            target.load_state_dict({k: v.clone() for k, v in target.state_dict().items()}, assign=True)
            conn.send("assigned")
        elif cmd == "reshape":
            next(m for m in target.modules() if isinstance(m, VersionNet)).ps[0] = nn.Parameter(torch.zeros(3))
            conn.send("reshaped")
        elif cmd == "repoint_held":
            with scheme.hold():
                try:
                    scheme.model = copy.deepcopy(model)
                    conn.send(None)
                except Exception as exc:
                    conn.send(type(exc).__name__)
        elif cmd == "shutdown":
            scheme.shutdown()
            scheme.shutdown()  # idempotent
            conn.send(("closed", [float(p[0].detach()) for p in target.parameters()]))
        elif cmd == "exit":
            conn.send("bye")
            return
