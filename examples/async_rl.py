"""An asynchronous actor-learner that solves CartPole-v1 with asyncsync.

Rollout workers (``--workers`` processes, spawned with ``spawn_workers``) each run
``--envs-per-worker`` gymnasium environments as concurrent asyncio tasks on their own event
loop. The environments ask one policy task per worker for actions; it batches their
observations into one forward pass of the worker's local copy of the actor. New weights
land between two awaits of that loop (the scheme's receiver task), so every action comes
from exactly one version, and every transition is stamped with it (``scheme.version``).

Each environment sends a fragment of ``--fragment`` transitions at a time to the trainer
over the library's own ``AsyncQueue`` (one pipe per worker; a fragment is a dict of small
numpy arrays, pickled: 2.4 KB for 32 CartPole steps, so shared memory would buy nothing
here; a worker producing images would put its frames in shared memory and send their
indices). An environment collects at most ``--ahead`` fragments ahead of the learner's
version (its k-th fragment waits for version k - ahead): the learner uses one fragment per
environment per version, so collecting further ahead would only produce rollouts it drops
as stale, on CPU cores the learner needs.

The learner is PPO with the clipped ratio taken against the *behaviour* policy: each
transition carries the log-probability its (possibly older) policy gave the action, so a
rollout a version or two old is corrected by the importance ratio, and the clip keeps the
update within a trust region of the policy that acted (asynchronous PPO, as in Sample
Factory's APPO). Rollouts whose oldest transition is more than ``--max-lag`` versions older
than the learner are dropped (and counted). Advantages are GAE(0.95) computed with the
learner's current critic, normalised per minibatch. Why PPO rather than IMPALA's V-trace:
with two workers on two cores the lag stays at one or two versions, where the clipped
ratio is all the correction needed, and PPO's several epochs per batch get more learning
out of every environment step, which is what is scarce on a CPU. V-trace would be the
choice with many workers and long lags.

The trainer never waits for the slowest worker: it publishes each version with
``send_async`` and only bounds how far it may run ahead with
``wait_async(version - max_lag, quorum=--quorum)``. ``--sync`` is the synchronous baseline:
``send()`` waits for every worker, and each environment returns exactly one fragment per
version, of the current version, before waiting for the next (use it with
``--max-lag 0``).

Run:
    python examples/async_rl.py                       # async, stop at a mean return of 450
    python examples/async_rl.py --sync --max-lag 0    # the synchronous baseline
    python examples/async_rl.py --out runs/s1 --seed 1 --time-limit 180
    python examples/async_rl.py --plot-runs runs/s1 runs/s2 --plot runs/async_rl.png

Writes ``DIR/summary.json`` (time to the target, env steps/s, weight-sync latency p50/p99,
dropped rollouts, final mean return, greedy evaluation, seed, settings, the learning curve)
and ``DIR/learning_curve.png`` (needs matplotlib; ``pip install torch==2.13.0 -e '.[examples]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from asyncsync import AsyncQueue, BrokenChannelError, ClosedError, MultiProcessWeightSyncScheme, spawn_workers

ENV_ID = "CartPole-v1"
OBS_DIM, N_ACTIONS = 4, 2
RETURN_WINDOW = 20  # "mean return" is over the last 20 episodes


# ----------------------------------------------------------------------------- networks


def _layer(n_in: int, n_out: int, gain: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def make_actor(hidden: int = 64) -> nn.Module:
    """The policy the workers run: observation -> action logits (2x64 tanh MLP)."""
    return nn.Sequential(_layer(OBS_DIM, hidden, math.sqrt(2)), nn.Tanh(), _layer(hidden, hidden, math.sqrt(2)), nn.Tanh(), _layer(hidden, N_ACTIONS, 0.01))


def make_critic(hidden: int = 64) -> nn.Module:
    """The value function, trainer-side only (never sent)."""
    return nn.Sequential(_layer(OBS_DIM, hidden, math.sqrt(2)), nn.Tanh(), _layer(hidden, hidden, math.sqrt(2)), nn.Tanh(), _layer(hidden, 1, 1.0))


# ----------------------------------------------------------------------------- worker


async def rollout_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, writers: list[Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Run ``cfg["envs"]`` environments as asyncio tasks; stream stamped fragments to the trainer."""
    import gymnasium as gym

    torch.set_num_threads(1)
    if cfg["nice"]:
        os.nice(cfg["nice"])  # the learner is the critical path: let it have its core when it needs it
    for i, w in enumerate(writers):  # keep our own pipe end only: the trainer sees EOF when we exit
        if i != worker_idx:
            w.close()
    out: AsyncQueue[dict[str, Any]] = AsyncQueue(writers[worker_idx])
    actor = make_actor(cfg["hidden"])
    applied: list[tuple[int, float]] = []  # (version, when it was committed here): the trainer computes the sync latency
    scheme.init_on_receiver(worker_idx=worker_idx, model=actor, on_update=lambda _weights, version: applied.append((version, time.perf_counter())))
    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + worker_idx + 1)
    loop = asyncio.get_running_loop()
    requests: list[tuple[np.ndarray, asyncio.Future[tuple[int, float, int]]]] = []
    wake = asyncio.Event()
    T = cfg["fragment"]
    ahead = cfg["ahead"]
    counts = {"steps": 0, "fragments": 0, "episodes": 0, "forward_batches": 0}

    async def policy_server() -> None:
        """One forward pass for every environment waiting for an action."""
        while True:
            await wake.wait()
            wake.clear()
            batch = requests[:]
            requests.clear()
            obs = torch.from_numpy(np.stack([o for o, _ in batch]))
            with torch.no_grad():  # no await from here to the replies: one version per batch
                logp_all = torch.log_softmax(actor(obs), dim=-1)
                actions = torch.multinomial(logp_all.exp(), 1, generator=gen)
                logp = logp_all.gather(1, actions).squeeze(1)
            version = scheme.version
            counts["forward_batches"] += 1
            for (_, reply), a, lp in zip(batch, actions.squeeze(1).tolist(), logp.tolist()):
                reply.set_result((a, lp, version))

    async def run_env(env_idx: int) -> None:
        env = gym.make(ENV_ID)
        obs, _ = env.reset(seed=cfg["seed"] * 1000 + worker_idx * 100 + env_idx)
        ep_return, ep_len = 0.0, 0
        k = 0  # fragments this env has collected
        while True:
            # The k-th fragment waits for version k - ahead: the env runs at most `ahead`
            # fragments ahead of the learner, which uses one fragment per env per version.
            # Collecting more than that would only make rollouts that the learner drops as
            # stale (and take CPU from it). ahead=0 (the synchronous baseline): exactly one
            # fragment per env on each version, of that version.
            if scheme.version < k - ahead:
                try:
                    await scheme.wait_for_version(k - ahead, timeout=None)
                except ClosedError:  # the trainer stopped us while we waited
                    return
            k += 1
            frag = {
                "obs": np.empty((T, OBS_DIM), np.float32),
                "next_obs": np.empty((T, OBS_DIM), np.float32),  # the real last observation at an episode end
                "actions": np.empty(T, np.int64),
                "logp": np.empty(T, np.float32),  # behaviour policy's log-probability of the action
                "rewards": np.empty(T, np.float32),
                "terminated": np.zeros(T, np.bool_),
                "truncated": np.zeros(T, np.bool_),
                "versions": np.empty(T, np.int64),  # the policy version that chose each action
            }
            episodes: list[tuple[float, int, int]] = []
            for t in range(T):
                reply: asyncio.Future[tuple[int, float, int]] = loop.create_future()
                requests.append((obs, reply))
                wake.set()
                action, logp, version = await reply
                next_obs, reward, terminated, truncated, _ = env.step(action)
                frag["obs"][t] = obs
                frag["next_obs"][t] = next_obs
                frag["actions"][t] = action
                frag["logp"][t] = logp
                frag["rewards"][t] = reward
                frag["terminated"][t] = terminated
                frag["truncated"][t] = truncated
                frag["versions"][t] = version
                ep_return += float(reward)
                ep_len += 1
                if terminated or truncated:
                    episodes.append((ep_return, ep_len, version))
                    ep_return, ep_len = 0.0, 0
                    next_obs, _ = env.reset()
                obs = next_obs
            frag["episodes"] = episodes
            frag["worker"], frag["env"] = worker_idx, env_idx
            frag["applied"] = applied[:]
            applied.clear()
            await out.put(frag)
            counts["steps"] += T
            counts["fragments"] += 1
            counts["episodes"] += len(episodes)

    async with scheme:  # the receiver task runs on this loop; version 0 is applied on entry
        stopped = asyncio.ensure_future(scheme.wait_stopped())
        tasks = [asyncio.ensure_future(policy_server())] + [asyncio.ensure_future(run_env(i)) for i in range(cfg["envs"])]
        await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                raise outcome
        await stopped
        stats = scheme.receiver.statistics()
    await out.aclose()
    return {**counts, "version": scheme.version, "updates": stats.updates, "skipped": stats.skipped}


# ----------------------------------------------------------------------------- learner


class Learner:
    """PPO on batches of fragments, ratio against the behaviour policy's log-probabilities."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.actor = make_actor(args.hidden)
        self.critic = make_critic(args.hidden)
        self.optim = torch.optim.Adam([*self.actor.parameters(), *self.critic.parameters()], lr=args.lr, eps=1e-5, fused=True)

    def advantages(self, frags: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Stack the fragments (F, T) and compute GAE with the current critic."""
        cat = {k: torch.from_numpy(np.stack([f[k] for f in frags])) for k in ("obs", "next_obs", "actions", "logp", "rewards", "terminated", "truncated")}
        F, T = cat["actions"].shape
        with torch.no_grad():
            values = self.critic(cat["obs"]).squeeze(-1)
            next_values = self.critic(cat["next_obs"]).squeeze(-1)
        not_terminated = (~cat["terminated"]).float()
        not_done = (~(cat["terminated"] | cat["truncated"])).float()
        deltas = cat["rewards"] + self.args.gamma * next_values * not_terminated - values
        adv = torch.zeros(F, T)
        running = torch.zeros(F)
        for t in reversed(range(T)):  # the GAE trace stops at episode ends and at the fragment's end
            running = deltas[:, t] + self.args.gamma * self.args.gae_lambda * not_done[:, t] * running
            adv[:, t] = running
        return {
            "obs": cat["obs"].reshape(F * T, OBS_DIM),
            "actions": cat["actions"].reshape(-1),
            "logp": cat["logp"].reshape(-1),
            "adv": adv.reshape(-1),
            "returns": (adv + values).reshape(-1),
        }

    async def update(self, frags: list[dict[str, Any]], rng: torch.Generator) -> dict[str, float]:
        """``--epochs`` passes of ``--minibatches`` Adam steps; awaits between steps so the
        trainer's loop keeps reading rollouts and acks while it trains."""
        a = self.args
        data = self.advantages(frags)
        n = data["actions"].shape[0]
        mb = max(1, n // a.minibatches)
        clipped = 0.0
        steps = 0
        for _ in range(a.epochs):
            perm = torch.randperm(n, generator=rng)
            for start in range(0, n - mb + 1, mb):
                idx = perm[start : start + mb]
                logits = self.actor(data["obs"][idx])
                logp_all = torch.log_softmax(logits, dim=-1)
                logp = logp_all.gather(1, data["actions"][idx, None]).squeeze(1)
                entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
                ratio = torch.exp(logp - data["logp"][idx])  # new policy / the policy that acted
                adv = data["adv"][idx]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                pg_loss = -torch.min(ratio * adv, ratio.clamp(1 - a.clip, 1 + a.clip) * adv).mean()
                v_loss = 0.5 * (self.critic(data["obs"][idx]).squeeze(-1) - data["returns"][idx]).pow(2).mean()
                loss = pg_loss + a.vf_coef * v_loss - a.ent_coef * entropy
                self.optim.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_([*self.actor.parameters(), *self.critic.parameters()], a.max_grad_norm)
                self.optim.step()
                clipped += float(((ratio - 1).abs() > a.clip).float().mean())
                steps += 1
                await asyncio.sleep(0)  # let the reader tasks and the scheme's ack reader run
        return {"clip_frac": clipped / max(steps, 1)}


def evaluate(actor: nn.Module | None, episodes: int, seed: int) -> float:
    """Mean return over fixed seeds: greedy actions of *actor*, or uniform random ones (None)."""
    import gymnasium as gym

    env = gym.make(ENV_ID)
    rng = np.random.default_rng(seed)
    total = 0.0
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        done = False
        while not done:
            if actor is None:
                action = int(rng.integers(N_ACTIONS))
            else:
                with torch.no_grad():
                    action = int(actor(torch.as_tensor(obs, dtype=torch.float32)).argmax())
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
    env.close()
    return total / episodes


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return float(np.percentile(np.asarray(xs), q))


class Progress:
    """The run's vital signs: a tqdm bar counting episodes (``"bar"``), a plain line every
    few seconds on stdout for a log file or CI (``"lines"``), or nothing (``"off"``)."""

    EVERY_S = {"bar": 0.5, "lines": 5.0}

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(unit="ep", desc="episodes", dynamic_ncols=True)
        self.shown = 0
        self.started = self.last = time.perf_counter()

    def update(self, episodes: int, postfix: Callable[[], dict[str, Any]], force: bool = False) -> None:
        """Redraw (a bar: at most twice a second; lines: one every 5 s); *postfix* is only called then."""
        now = time.perf_counter()
        if self.mode == "off" or (not force and now - self.last < self.EVERY_S[self.mode]):
            return
        self.last = now
        if self.bar is not None:
            self.bar.update(episodes - self.shown)
            self.shown = episodes
            self.bar.set_postfix(postfix(), refresh=True)
        else:
            signs = "  ".join(f"{k} {v}" for k, v in postfix().items())
            print(f"{now - self.started:6.1f} s  {episodes} episodes  {signs}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _read_rollouts(queue: AsyncQueue[dict[str, Any]], inbox: asyncio.Queue[dict[str, Any]]) -> None:
    try:
        while True:
            inbox.put_nowait(await queue.get())
    except BrokenChannelError:  # the worker closed its end, or died: tell the learner
        inbox.put_nowait({"ended": True})


async def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = torch.Generator().manual_seed(args.seed)
    learner = Learner(args)
    scheme = MultiProcessWeightSyncScheme(sync=args.sync, timeout=60)
    scheme.init_on_sender(model=learner.actor, num_workers=args.workers)  # only the actor travels
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(args.workers)]
    readers, writers = [r for r, _ in pipes], [w for _, w in pipes]
    cfg = {
        "hidden": args.hidden,
        "seed": args.seed,
        "fragment": args.fragment,
        "envs": args.envs_per_worker,
        "ahead": 0 if args.sync else args.ahead,
        "nice": args.worker_nice,
    }
    batch_frags = args.workers * args.envs_per_worker  # a batch: one fragment's worth per environment
    batch_size = batch_frags * args.fragment

    t0 = time.perf_counter()
    curve: list[tuple[float, int, float, float]] = []  # (wall s, env steps, episode return, mean of last 20)
    recent: deque[float] = deque(maxlen=RETURN_WINDOW)
    env_steps = 0
    used = dropped = dropped_steps = 0
    lag_hist: dict[int, int] = {}
    published: dict[int, float] = {}  # version -> when the trainer started publishing it
    sync_ms: list[float] = []  # publish -> committed on a worker, per (worker, version)
    publish_ms: list[float] = []  # duration of the send_async (or send) call
    quorum_wait_s = 0.0
    update_s = 0.0  # time the learner spent in PPO updates
    newest_stamp = -1  # the newest policy version stamped on a transition the learner received
    time_to_target: float | None = None
    steps_to_target: int | None = None
    stop_reason = "time limit"
    progress: Progress | None = None

    rate_mark = [0.0, 0]  # (time, env steps) at the previous postfix: steps/s over the last interval

    def postfix() -> dict[str, Any]:
        stats = scheme.sender.statistics()
        now = time.perf_counter()
        sps = (env_steps - rate_mark[1]) / max(now - rate_mark[0], 1e-9)
        rate_mark[:] = [now, env_steps]
        return {
            "ret": f"{np.mean(recent):.0f}" if recent else "-",  # mean of the last 20 episodes
            "v": stats.version,  # policy version
            "lag": max(w.lag for w in stats.workers),  # versions the slowest worker is behind
            "sync_ms": f"{np.median(sync_ms[-50:]):.1f}" if sync_ms else "-",  # publish -> applied on a worker
            "sps": f"{sps:.0f}",  # env steps per second
            "drop": dropped,  # stale rollouts dropped
        }

    async with spawn_workers(rollout_worker, args.workers, args=(scheme, writers, cfg), scheme=scheme) as group:
        for w in writers:
            w.close()  # the workers hold their ends now
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        queues: list[AsyncQueue[dict[str, Any]]] = [AsyncQueue(r) for r in readers]
        reader_tasks = [asyncio.ensure_future(_read_rollouts(q, inbox)) for q in queues]
        ended = 0  # rollout streams that ended
        try:
            async with scheme:  # version 0 to every worker
                t_train = rate_mark[0] = time.perf_counter()
                startup_s = t_train - t0
                n = args.workers
                print(f"{n} worker{'' if n == 1 else 's'} run{'s' if n == 1 else ''} version 0, {startup_s:.1f} s after the start; training", flush=True)
                progress = Progress(args.progress)
                done = False
                while not done:
                    batch: list[dict[str, Any]] = []
                    while len(batch) < batch_frags and not done:
                        remaining = args.time_limit - (time.perf_counter() - t0)
                        try:
                            frag = await asyncio.wait_for(inbox.get(), timeout=max(remaining, 0.0))
                        except asyncio.TimeoutError:
                            done = True
                            break
                        if "ended" in frag:  # a worker's rollout stream ended: go on with the others
                            ended += 1
                            if ended == args.workers:
                                states = {w.worker_idx: w.reason or w.state for w in scheme.sender.statistics().workers}
                                raise RuntimeError(f"every rollout worker is gone: {states}")
                            continue
                        now = time.perf_counter() - t0
                        env_steps += len(frag["actions"])
                        for version, when in frag["applied"]:  # perf_counter is CLOCK_MONOTONIC: one clock for all processes
                            if version in published:
                                sync_ms.append((when - published[version]) * 1e3)
                        for ep_return, _, _ in frag["episodes"]:
                            recent.append(ep_return)
                            curve.append((now, env_steps, ep_return, float(np.mean(recent))))
                        if time_to_target is None and len(recent) == RETURN_WINDOW and np.mean(recent) >= args.target:
                            time_to_target, steps_to_target = now, env_steps
                            if not args.run_to_limit:
                                stop_reason, done = "target reached", True
                        newest_stamp = max(newest_stamp, int(frag["versions"].max()))
                        lag = scheme.version - int(frag["versions"].min())
                        lag_hist[lag] = lag_hist.get(lag, 0) + 1
                        if lag > args.max_lag:
                            dropped += 1
                            dropped_steps += len(frag["actions"])
                        else:
                            batch.append(frag)
                        progress.update(len(curve), postfix)
                    if done:
                        break
                    batch.sort(key=lambda f: (f["worker"], f["env"]))  # a reproducible batch order
                    update_started = time.perf_counter()
                    await learner.update(batch, rng)
                    update_s += time.perf_counter() - update_started
                    used += len(batch)
                    started = published[scheme.version + 1] = time.perf_counter()
                    if args.sync:
                        await scheme.send()  # returns once every worker applied it
                        publish_ms.append((time.perf_counter() - started) * 1e3)
                    else:
                        version = await scheme.send_async()  # the snapshot is taken; waits for no worker
                        publish_ms.append((time.perf_counter() - started) * 1e3)
                        waited = time.perf_counter()
                        # run at most max_lag versions ahead of a quorum of workers
                        await scheme.wait_async(version=max(0, version - args.max_lag), quorum=args.quorum)
                        quorum_wait_s += time.perf_counter() - waited
                    if args.max_updates is not None and scheme.version >= args.max_updates:
                        stop_reason, done = "max updates", True
                train_s = time.perf_counter() - t_train
                await scheme.wait_async()  # once, at the end: every worker finishes on the final policy
                progress.update(len(curve), postfix, force=True)
                sender_stats = scheme.sender.statistics()
            results = await group.join()
        finally:
            if progress is not None:
                progress.close()
            for task in reader_tasks:
                task.cancel()
            await asyncio.gather(*reader_tasks, return_exceptions=True)
            for q in queues:
                q.close()

    wall_s = time.perf_counter() - t0
    returns = [c[2] for c in curve]
    summary: dict[str, Any] = {
        "mode": "sync" if args.sync else "async",
        "seed": args.seed,
        "target": args.target,
        "reached": time_to_target is not None,
        "time_to_target_s": time_to_target,
        "env_steps_to_target": steps_to_target,
        "stop_reason": stop_reason,
        "wall_s": wall_s,
        "startup_s": startup_s,
        "train_s": train_s,
        "env_steps": env_steps,
        "env_steps_per_s": env_steps / train_s,
        "updates": sender_stats.version,
        "batch_size": batch_size,
        "sync_latency_ms": {"p50": _pct(sync_ms, 50), "p99": _pct(sync_ms, 99), "n": len(sync_ms)},
        "publish_ms": {"p50": _pct(publish_ms, 50), "p99": _pct(publish_ms, 99)},
        "quorum_wait_s": quorum_wait_s,
        "update_s": update_s,
        "fragments_used": used,
        "dropped_rollouts": dropped,
        "dropped_env_steps": dropped_steps,
        "newest_rollout_version": newest_stamp,
        "rollout_lag_histogram": {str(k): v for k, v in sorted(lag_hist.items())},
        "episodes": len(curve),
        "final_mean_return": float(np.mean(returns[-RETURN_WINDOW:])) if returns else None,
        "eval_greedy_return": evaluate(learner.actor, args.eval_episodes, 10_000 + args.seed),
        "eval_random_return": evaluate(None, args.eval_episodes, 10_000 + args.seed),
        "workers": {str(k): v for k, v in results.items()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("plot_runs",)},
        "machine": {"cpus": mp.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0]},
        "curve": curve,
    }
    return summary


# ----------------------------------------------------------------------------- outputs


def plot_runs(summaries: list[dict[str, Any]], path: Path) -> None:
    """Mean return (last 20 episodes) against wall time and against env steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    # one colour family per mode, one shade and line style per run of that mode
    cmaps = {"async": plt.get_cmap("Blues"), "sync": plt.get_cmap("Oranges")}
    styles = ["-", "--", "-.", ":"]
    runs = [s for s in summaries if s["curve"]]
    for s in runs:
        mode = s["mode"]
        same_mode = [r for r in runs if r["mode"] == mode]
        k = same_mode.index(s)
        color = cmaps[mode](0.9 - 0.5 * k / max(len(same_mode) - 1, 1))
        style = styles[k % len(styles)]
        wall, steps, _, mean = (np.asarray(c) for c in zip(*s["curve"]))
        label = f"{mode} ({'send_async' if mode == 'async' else 'send'}), seed {s['seed']}"
        ax_t.plot(wall, mean, color=color, ls=style, alpha=0.9, label=label)
        ax_s.plot(steps, mean, color=color, ls=style, alpha=0.9)
    for ax in (ax_t, ax_s):
        ax.axhline(summaries[0]["target"], color="grey", ls="--", lw=1, label=f"target {summaries[0]['target']:g}" if ax is ax_t else None)
        ax.grid(alpha=0.3)
    ax_t.set_xlabel("wall time since launch (s)")
    ax_s.set_xlabel("environment steps")
    ax_t.set_ylabel(f"mean return, last {RETURN_WINDOW} episodes")
    seeds = sorted({s["seed"] for s in summaries})
    fig.suptitle(f"{ENV_ID}, PPO, 2 rollout workers, seeds {seeds}")
    ax_t.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="rollout worker processes")
    p.add_argument("--envs-per-worker", type=int, default=8, help="environments per worker, each an asyncio task")
    p.add_argument("--fragment", type=int, default=32, help="transitions per rollout fragment sent to the trainer")
    p.add_argument("--max-lag", type=int, default=4, help="drop rollouts more than this many versions older than the learner")
    p.add_argument("--ahead", type=int, default=1, help="fragments an env may collect ahead of the learner's version (async; --sync: 0)")
    p.add_argument("--worker-nice", type=int, default=0, help="raise the workers' niceness by this much (the learner keeps its priority)")
    p.add_argument("--quorum", type=int, default=1, help="workers that must run version v - max_lag before the trainer goes on")
    p.add_argument("--sync", action="store_true", help="synchronous baseline: send() waits for all workers, one fragment per env per version")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=450.0, help="mean return over the last 20 episodes to reach")
    p.add_argument("--time-limit", type=float, default=180.0, help="seconds of wall time, process start-up included")
    p.add_argument("--run-to-limit", action="store_true", help="keep training after the target until the time limit")
    p.add_argument("--max-updates", type=int, default=None, help="stop after this many policy versions")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--ent-coef", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--eval-episodes", type=int, default=10, help="greedy vs random evaluation episodes at the end")
    p.add_argument("--out", type=Path, default=Path("runs/async_rl"), help="directory for summary.json and learning_curve.png")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG (no matplotlib needed)")
    p.add_argument("--no-progress", action="store_true", help="no progress (a bar on a terminal, else a line every 5 s)")
    p.add_argument("--plot-runs", type=Path, nargs="+", default=None, metavar="DIR", help="only plot these runs' summary.json into --plot")
    p.add_argument("--plot", type=Path, default=None, help="PNG path for --plot-runs")
    args = p.parse_args(argv)
    args.progress = "off" if args.no_progress else "bar" if sys.stderr.isatty() else "lines"
    if args.sync and args.max_lag != 0:
        p.error("--sync is the on-policy baseline: use it with --max-lag 0")
    if not 1 <= args.quorum <= args.workers:
        p.error("--quorum must be between 1 and --workers")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.plot_runs:
        summaries = [json.loads((d / "summary.json").read_text()) for d in args.plot_runs]
        path = args.plot or Path("async_rl.png")
        plot_runs(summaries, path)
        runs = ", ".join(f"{s['mode']} seed {s['seed']}" for s in summaries)
        print(f"wrote {path}: {len(summaries)} runs ({runs})")
        return {}
    mode = "sync" if args.sync else "async"
    print(f"imports done; training ({mode}) with {args.workers} worker process{'' if args.workers == 1 else 'es'}...", flush=True)
    summary = asyncio.run(train(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if not args.no_plot:
        plot_runs([summary], args.out / "learning_curve.png")
    lat = summary["sync_latency_ms"]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    ttt = summary["time_to_target_s"]
    print(
        f"{summary['mode']} seed {args.seed}: {summary['stop_reason']}"
        f" | time to {args.target:g}: {'not reached' if ttt is None else f'{ttt:.1f} s'}"
        f" | {summary['env_steps']} env steps, {summary['env_steps_per_s']:.0f}/s, {summary['updates']} versions"
        f" | sync p50/p99 {fmt(lat['p50'])}/{fmt(lat['p99'])} ms"
        f" | dropped {summary['dropped_rollouts']} rollouts"
        f" | final mean return {fmt(summary['final_mean_return'])}"
        f" | greedy {summary['eval_greedy_return']:.1f} vs random {summary['eval_random_return']:.1f}"
        f" | {args.out / 'summary.json'}"
    )
    return summary


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # asyncsync's start-up progress
    main()
