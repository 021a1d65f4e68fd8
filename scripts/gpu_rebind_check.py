"""GPU check of a worker that replaces its model's tensors (cuda:0; swap, copy, bf16 transfer): each version lands in the tensors the model holds, a CPU submodule is refused naming its key, and fixing it lets the next version apply. Run: python scripts/gpu_rebind_check.py [device]"""
import asyncio, json, sys
import torch
from torch import nn
from asyncsync import MultiProcessWeightSyncScheme, WorkerError
from asyncsync.testing import open_loopback

DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"

def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))

def fill(m, v):
    with torch.no_grad():
        for p in m.parameters(): p.fill_(v)
    return m

def vals(m):
    return {k: sorted({float(x) for x in t.detach().float().cpu().flatten().tolist()}) for k, t in m.state_dict().items()}

async def case(**opts):
    out = {}
    trainer = make()
    scheme = MultiProcessWeightSyncScheme(timeout=60, strategy="state_dict", **opts)
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, make, device=DEV) as lb:
        m = lb.models[0]
        async def step(v):
            fill(trainer, v); await scheme.send(); return vals(m)
        out["device"] = str(next(m.parameters()).device)
        out["v1"] = await step(1.0)
        m[2] = fill(nn.Linear(16, 3).to(DEV), -5.0)
        out["submodule"] = await step(2.0)
        m.load_state_dict({k: torch.full_like(t, -7.0) for k, t in m.state_dict().items()}, assign=True)
        out["assign"] = await step(3.0)
        m[2] = fill(nn.Linear(16, 3), -5.0)  # on the CPU
        try:
            await step(4.0); out["cpu_submodule"] = "applied?!"
        except WorkerError as exc:
            out["cpu_submodule"] = exc.message
        out["after_refusal"] = vals(m)
        m[2] = fill(nn.Linear(16, 3).to(DEV), -5.0)
        out["fixed"] = await step(5.0)
        out["ok"] = (all(v == [2.0] for v in out["submodule"].values()) and all(v == [3.0] for v in out["assign"].values())
                     and "'2.weight'" in out["cpu_submodule"] and all(v == [5.0] for v in out["fixed"].values())
                     and out["device"] == str(torch.device(DEV)))
    return out

async def main():
    res = {}
    for name, opts in (("swap", {}), ("copy", {"commit": "copy"}), ("swap-bf16", {"transfer_dtype": torch.bfloat16})):
        res[name] = await case(**opts)
    print(json.dumps(res, indent=1))
    sys.exit(0 if all(r["ok"] for r in res.values()) else 1)

asyncio.run(main())
