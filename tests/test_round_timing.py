"""Per-round verify time includes the device's work: engine.verify returns logits still on the
device, so the clock is read after a synchronize on CUDA (round_stats.settle). The CUDA branch is
reached here with torch.cuda.synchronize replaced by a recorder."""
from types import SimpleNamespace

import torch

import dsv4_tree as dt
import dsv4_tree.round_stats as rs


def test_settle_synchronizes_cuda_only(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(str(device)))
    rs.settle(torch.device("cpu"))
    rs.settle("meta")
    assert seen == []
    rs.settle(torch.device("cuda", 1))
    assert seen == ["cuda:1"]


def test_timed_verify_reads_the_clock_after_the_device_work(monkeypatch):
    order = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append("sync"))
    engine = SimpleNamespace(model=SimpleNamespace(device=torch.device("cuda", 0)),
                             verify=lambda reqs, trees: order.append("verify") or "out")
    real = rs.time.perf_counter
    monkeypatch.setattr(rs.time, "perf_counter", lambda: order.append("clock") or real())
    out, secs = rs.timed_verify(engine, [], [])
    assert out == "out" and secs >= 0
    assert order == ["clock", "verify", "sync", "clock"]


def test_generate_times_every_verify_through_settle(monkeypatch):
    model = dt.load_model(dt.tiny_checkpoint())
    eng = dt.Engine(model, dt.SpecConfig(eagle_topk=2, num_steps=2, num_draft_tokens=4))
    devices = []
    monkeypatch.setattr(rs, "settle", lambda device: devices.append(device))
    res = eng.generate(torch.arange(20) % 50 + 3, 5, drafter="mtp", progress=False)
    assert len(devices) == res.stats.rounds and set(devices) == {model.device}
    devices.clear()
    out = eng.generate_batch([torch.arange(20) % 50 + 3, torch.arange(12) + 5], [4, 6], drafter="mtp", progress=False)
    assert len(devices) == max(r.stats.rounds for r in out) and set(devices) == {model.device}
