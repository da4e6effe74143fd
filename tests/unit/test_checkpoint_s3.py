"""Checkpoints on a real S3-compatible server on localhost (moto in server mode, started here),
through the real s3fs client: save/load/resume exact, a kill at every upload step keeps ``last``
loadable, a tampered object is refused; 2 DDP ranks save in the background, 2 FSDP ranks upload
their shards through DCP's fsspec writer, resume exactly, and a kill before the commit keeps ``last``.

The client finds the server the way a user points it at theirs: ``AWS_ENDPOINT_URL`` and the
``AWS_*`` credentials in the environment (botocore reads them). Skipped without moto/s3fs.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import torchrig
from conftest import python_env, trained_mlp
from torchrig.checkpoint import CheckpointError

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    """A moto S3 server on a free localhost port for this module; its endpoint URL."""
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def bucket(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the server, with the environment pointing the client at it."""
    for k, v in {**S3_ENV, "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    name = f"torchrig-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().mkdir(name)
    return name


def test_save_load_exact_through_s3fs(bucket: str) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    model, opt = trained_mlp(0)
    assert rig.save(f"s3://{bucket}/run/step-1", {"model": model, "optimizer": opt, "step": 1}) == (
        f"s3://{bucket}/run/step-1"
    )
    keys = s3fs.S3FileSystem().find(f"{bucket}/run")
    assert f"{bucket}/run/last" in keys and any(k.endswith("/meta.json") for k in keys)
    other, other_opt = trained_mlp(1)
    assert rig.load(f"s3://{bucket}/run/last", {"model": other, "optimizer": other_opt})["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))
    for s, t in zip(opt.state.values(), other_opt.state.values(), strict=True):
        assert all(torch.equal(s[k], t[k]) for k in s)
    assert rig.load(f"s3://{bucket}/run/step-1")["step"] == 1  # by its own name too
    rig.save(f"s3://{bucket}/run/step-2", {"model": model, "step": 2}, keep_last=1)
    assert sorted(k.rsplit("/", 1)[-1] for k in s3fs.S3FileSystem().ls(f"{bucket}/run", refresh=True)) == [
        "last",
        "step-2",
    ]


def test_a_tampered_object_is_refused_by_the_digest_taken_as_it_downloaded(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchrig.checkpoint import reading

    rig = torchrig.Rig(accelerator="cpu")
    model, _ = trained_mlp(0)
    rig.save(f"s3://{bucket}/ck", {"model": model, "step": 1})
    fs = s3fs.S3FileSystem()
    (key,) = [k for k in fs.find(f"{bucket}/ck") if k.endswith("/state.pt")]
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    rehashed: list[Path] = []  # no downloaded file is read back to be hashed
    monkeypatch.setattr(reading, "sha256_file", lambda path, size=None: rehashed.append(path))
    digest = hashlib.sha256(data).hexdigest()
    with pytest.raises(
        CheckpointError, match=rf"^checksum mismatch in s3://{key}: SHA-256 is {digest}, meta\.json says"
    ):
        rig.load(f"s3://{bucket}/last", {"model": model})
    assert rehashed == []


def test_an_object_deleted_after_the_commit_is_refused_by_its_url(bucket: str) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    model, _ = trained_mlp(0)
    rig.save(f"s3://{bucket}/ck", {"model": model, "step": 1})
    fs = s3fs.S3FileSystem()
    (key,) = [k for k in fs.find(f"{bucket}/ck") if k.endswith("/model.safetensors")]
    fs.rm_file(key)
    with pytest.raises(CheckpointError, match=rf"^s3://{key} is missing; meta\.json lists it \([0-9]+ bytes\)"):
        rig.load(f"s3://{bucket}/last", {"model": model})


def test_a_save_to_a_name_that_is_an_object_is_refused(bucket: str) -> None:
    # S3 keeps the object ``ck`` beside the prefix ``ck/``: the save used to upload and commit
    # there, and every load of it then read the object ``ck`` and refused it as a broken link.
    fs = s3fs.S3FileSystem()
    fs.pipe_file(f"{bucket}/ck", b"notes")
    rig = torchrig.Rig(accelerator="cpu")
    model, _ = trained_mlp(0)
    with pytest.raises(CheckpointError, match=rf"^cannot save to s3://{bucket}/ck: an object of that name is there"):
        rig.save(f"s3://{bucket}/ck", {"model": model, "step": 1})
    assert fs.find(bucket, refresh=True) == [f"{bucket}/ck"]


def test_the_users_objects_are_never_written_over_nor_deleted_by_retention(bucket: str) -> None:
    fs, rig, (model, _) = s3fs.S3FileSystem(), torchrig.Rig(accelerator="cpu"), trained_mlp(0)
    rig.save(f"s3://{bucket}/step-1", {"model": model, "step": 1})
    mine = {f"{bucket}/data/train.csv": b"x,y\n", f"{bucket}/step-1/NOTES.md": b"why", f"{bucket}/LAST": b"."}
    for key, data in mine.items():
        fs.pipe_file(key, data)
    with pytest.raises(CheckpointError, match=rf"^cannot save to s3://{bucket}/data: the prefix .* \('train.csv'\)"):
        rig.save(f"s3://{bucket}/data", {"model": model, "step": 2})
    with pytest.raises(CheckpointError, match=rf"^cannot update the 'LAST' link: s3://{bucket}/LAST is an object that"):
        rig.save(f"s3://{bucket}/step-2", {"model": model, "step": 2}, link="LAST")
    rig.save(f"s3://{bucket}/step-2", {"model": model, "step": 2}, keep_last=1)  # step-1's versions go
    assert {k: fs.cat_file(k) for k in mine} == mine
    assert [k for k in fs.find(bucket, refresh=True) if k not in mine and "/v-" not in k] == [f"{bucket}/last"]


# One process imports torch once, then for every k forks a child that saves step 2 over step 1
# (same name, ``last`` pointing at it, an older checkpoint falling to keep_last) and dies
# (os._exit: no clean-up, as SIGKILL) at its k-th change on the server. The parent then loads
# ``last`` as it is, saves step 3 (which must tidy what the dead one left) and reports.
DRIVER = r"""
import json, os, sys
import s3fs, torch, torchrig

bucket = sys.argv[1]
rig = torchrig.Rig(accelerator="cpu")
model = torch.nn.Linear(3, 3)

def die_at(k, seen):
    for name in ("_put_file", "_pipe_file", "_rm_file", "_bulk_delete"):
        real = getattr(s3fs.S3FileSystem, name)
        async def op(self, *a, _real=real, _name=name, **kw):
            seen.append(_name + " " + str(a[-1] if _name == "_put_file" else a[0]))
            if len(seen) == k:
                os._exit(17)
            return await _real(self, *a, **kw)
        setattr(s3fs.S3FileSystem, name, op)

def replace_step_1(k):
    base = f"s3://{bucket}/k{k}"
    rig.save(f"{base}/old", {"model": model, "step": 0}, link=None)
    rig.save(f"{base}/ck", {"model": model, "step": 1})
    pid = os.fork()
    if pid == 0:
        s3fs.S3FileSystem.clear_instance_cache()
        seen = []
        die_at(k, seen)
        rig.save(f"{base}/ck", {"model": model, "step": 2}, keep_last=2)
        print(json.dumps({"ops": seen}), flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return base, os.waitstatus_to_exitcode(status)

results = []
for k in range(1, 40):
    base, code = replace_step_1(k)
    try:
        step = rig.load(f"{base}/last")["step"]
    except Exception as err:
        step = f"{type(err).__name__}: {err}"
    rig.save(f"{base}/ck", {"model": model, "step": 3})
    after = rig.load(f"{base}/last")["step"]
    versions = len(s3fs.S3FileSystem().ls(f"{bucket}/k{k}/ck"))
    results.append({"k": k, "code": code, "step": step, "after": after, "versions": versions})
    if code == 0:
        break
print(json.dumps(results))
"""


@pytest.mark.timeout(110)
def test_a_kill_at_every_upload_step_keeps_last_loadable(bucket: str, tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**python_env(), **S3_ENV, "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"]}
    out = subprocess.run([sys.executable, str(script), bucket], capture_output=True, text=True, timeout=100, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    ops: list[str] = json.loads(lines[-2])["ops"]  # the save that was not killed, in order
    results: list[dict[str, Any]] = json.loads(lines[-1])
    assert [r["code"] for r in results] == [17] * len(ops) + [0]  # killed at each change, then not
    commit = next(i for i, op in enumerate(ops) if op.endswith("/meta.json"))  # 0-based: the k of the commit - 1
    assert all(op.startswith("_put_file") for op in ops[:commit])  # every file before meta.json
    assert ops[commit + 1].startswith("_pipe_file") and ops[commit + 1].endswith("/last")
    for r in results:
        # Old or new, never nothing: the new one exactly once its meta.json was uploaded.
        assert r["step"] == (2 if r["k"] > commit + 1 else 1), r
        assert r["after"] == 3 and r["versions"] == 1, r  # the next save tidied the name


# Two DDP ranks (gloo) save to the server in the background and each loads it back.
DDP_SCRIPT = r"""
import sys
from pathlib import Path
import torch, torchrig

url, folder = sys.argv[1], Path(sys.argv[2])
rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="ddp")
torch.manual_seed(0)
model = rig.prepare(torch.nn.Linear(6, 3))
optimizer = rig.prepare(torch.optim.Adam(model.parameters(), lr=0.1))
rig.backward(model(torch.randn(4, 6) + rig.global_rank).square().mean())
optimizer.step()
handle = rig.save(f"{url}/step-1", {"model": model, "optimizer": optimizer, "step": 1}, blocking=False)
assert handle.wait() == f"{url}/step-1"
torch.manual_seed(1)
other = rig.prepare(torch.nn.Linear(6, 3))
other_opt = rig.prepare(torch.optim.Adam(other.parameters(), lr=0.1))
assert rig.load(f"{url}/last", {"model": other, "optimizer": other_opt}) == {"step": 1}
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
(folder / f"ok-{rig.global_rank}").touch()
"""


@pytest.mark.distributed
@pytest.mark.timeout(110)
def test_two_ddp_ranks_save_in_the_background_and_load_back(bucket: str, tmp_path: Path) -> None:
    from test_checkpoint_distributed import launch

    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    launch(
        f"s3://{bucket}/ddp",
        tmp_path,
        script=str(script),
        extra_env={**S3_ENV, "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"]},
    )
    assert {p.name for p in tmp_path.glob("ok-*")} == {"ok-0", "ok-1"}
    assert torchrig.checkpoint.describe(f"s3://{bucket}/ddp/last")["world_size"] == 2


# Every weight and optimizer moment of the FSDP scripts' model, whole (a collective: every rank calls it).
WHOLE = r"""
def whole():
    out = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for i, s in enumerate(optimizer.state.values()):
        out.update({f"opt.{i}.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in s.items()})
    return out
"""


def _fsdp_script(tmp_path: Path, source: str, name: str, bucket: str) -> tuple[str, str, dict[str, str]]:
    """``source`` written as ``NAME.py``; the script, the URL ``s3://BUCKET/NAME`` and the ranks' environment."""
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    url = f"s3://{bucket}/{name}"
    return str(script), url, {**S3_ENV, "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"], "TEST_S3_URL": url}


# Two FSDP ranks (gloo): DCP's fsspec writer uploads each rank's shards to the server. "train" saves
# step 2 (blocking) and step 4 (in the background, while steps 5-6 train), writes the weights and
# moments after step 6, then saves step 6 and rank 0 dies (os._exit) as it is about to upload that
# save's meta.json: every shard and state.pt are on the server, the commit is not. "resume" loads
# ``last`` on 2 new processes, trains steps 5-6 again and must reach the same weights exactly.
FSDP_SCRIPT = (
    r"""
import os, sys, threading, time
from pathlib import Path
import s3fs, torch, torchrig
from torch import nn

phase, folder = sys.argv[1], Path(sys.argv[2])
url = os.environ["TEST_S3_URL"]
rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="fsdp")
torch.manual_seed(0)
model = rig.prepare(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=0.05))
state = {"model": model, "optimizer": optimizer}

def train(first, last):
    for step in range(first, last + 1):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rig.global_rank))
        rig.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()

"""
    + WHOLE
    + r"""
if phase == "train":
    train(1, 2)
    assert rig.save(f"{url}/step-2", {**state, "step": 2}, keep_last=2) == f"{url}/step-2"
    train(3, 4)
    handle = rig.save(f"{url}/step-4", {**state, "step": 4}, keep_last=2, blocking=False)
    train(5, 6)
    assert handle.wait() == f"{url}/step-4"
    final = whole()
    pid0 = rig.broadcast(os.getpid())  # rank 0's
    if rig.is_global_zero:
        torch.save(final, folder / "final.pt")
        real = s3fs.S3FileSystem._put_file
        async def put_file(self, lpath, rpath, *a, **kw):
            if str(rpath).endswith("/meta.json"):
                os._exit(17)  # killed: no clean-up of any kind
            return await real(self, lpath, rpath, *a, **kw)
        s3fs.S3FileSystem._put_file = put_file
        s3fs.S3FileSystem.clear_instance_cache()  # an instance binds its sync methods when made
    else:
        def watch(pid):  # rank 1 goes when rank 0 is gone (it would wait for its outcome until a timeout)
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    os._exit(18)
                time.sleep(0.05)
        threading.Thread(target=watch, args=(pid0,), daemon=True).start()
    try:
        rig.save(f"{url}/step-6", {**state, "step": 6}, keep_last=2)
    except BaseException:
        os._exit(19)
    os._exit(20)
else:
    assert rig.load(f"{url}/last", state) == {"step": 4}
    train(5, 6)
    final = torch.load(folder / "final.pt")
    now = whole()
    assert now.keys() == final.keys() and all(torch.equal(now[k], final[k]) for k in final), "not resumed exactly"
    rig.save(f"{url}/step-6", {**state, "step": 6}, keep_last=2)
    (folder / f"ok-{rig.global_rank}").touch()
"""
)


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.timeout(200)
def test_two_fsdp_ranks_upload_shards_resume_exactly_and_survive_a_kill(bucket: str, tmp_path: Path) -> None:
    from test_checkpoint_distributed import launch

    script, url, env = _fsdp_script(tmp_path, FSDP_SCRIPT, "fsdp", bucket)
    (rank0, out0), _ = launch("train", tmp_path, script=script, extra_env=env, check=False)
    assert rank0 == 17, out0[-3000:]  # killed as it was about to commit step 6

    fs = s3fs.S3FileSystem()
    (version,) = fs.ls(f"{bucket}/fsdp/step-6", refresh=True)
    uploaded = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(version, refresh=True))
    assert uploaded == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]  # everything but meta.json
    info = torchrig.checkpoint.describe(f"{url}/last")
    assert (info["step"], info["sharded"], info["world_size"]) == (4, True, 2)  # the previous one
    assert all(ok for _, _, ok in info["verified"])

    launch("resume", tmp_path, script=script, extra_env=env)
    assert {p.name for p in tmp_path.glob("ok-*")} == {"ok-0", "ok-1"}
    assert torchrig.checkpoint.describe(f"{url}/last")["step"] == 6
    assert len(fs.ls(f"{bucket}/fsdp/step-6", refresh=True)) == 1  # the dead upload was tidied
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/fsdp", refresh=True)) == ["last", "step-4", "step-6"]

    # Saved by 2 ranks, read by 1 process: loaded into FSDP over one rank, and consolidated.
    final = torch.load(tmp_path / "final.pt")
    rig = torchrig.Rig(accelerator="cpu", strategy="fsdp")
    torch.manual_seed(1)
    model = rig.prepare(torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)))
    optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=0.05))
    assert rig.load(f"{url}/last", {"model": model, "optimizer": optimizer}) == {"step": 6}
    now = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for i, moments in enumerate(optimizer.state.values()):
        now.update({f"opt.{i}.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in moments.items()})
    assert now.keys() == final.keys() and all(torch.equal(now[k], final[k]) for k in final)
    weights = load_file(torchrig.checkpoint.consolidate(f"{url}/last", tmp_path / "w.safetensors"))
    assert {f"model.{k}" for k in weights} == {k for k in final if k.startswith("model.")}
    assert all(torch.equal(weights[k], final[f"model.{k}"]) for k in weights)


# Two FSDP ranks (gloo) load a checkpoint two ranks saved, through a real s3fs client whose every
# S3 GET is written down (a subclass of s3fs's file system, registered for s3://): loading the
# weights, each rank reads meta.json, state.pt, DCP's .metadata and its own shard object, never the
# other rank's; weights and moments come back exactly. Then rank 1's shard is altered on the server
# (same size): both ranks refuse the next load, naming the stored object, and neither changes a weight.
SHARD_FETCH_SCRIPT = (
    r"""
import os, sys
from pathlib import Path
import fsspec, s3fs, torch, torchrig
from torch import nn

phase, folder = sys.argv[1], Path(sys.argv[2])
url = os.environ["TEST_S3_URL"]
rig = torchrig.Rig(accelerator="cpu", devices=2, strategy="fsdp")
torch.manual_seed(0 if phase == "save" else 1)
model = rig.prepare(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4)))
optimizer = rig.prepare(torch.optim.AdamW(model.parameters(), lr=0.05))
x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rig.global_rank))
rig.backward(model(x).square().mean())
optimizer.step()
state = {"model": model, "optimizer": optimizer}

"""
    + WHOLE
    + r"""
if phase == "save":
    rig.save(f"{url}/ck", {**state, "step": 1})
    saved = whole()  # a collective: every rank
    if rig.is_global_zero:
        torch.save(saved, folder / "saved.pt")
    sys.exit(0)

gets = folder / f"gets-{rig.global_rank}.txt"
class CountingS3(s3fs.S3FileSystem):
    async def _call_s3(self, method, *args, **kwargs):
        if method == "get_object":
            with open(gets, "a") as f:
                f.write(kwargs["Key"].rsplit("/", 1)[-1] + "\n")
        return await super()._call_s3(method, *args, **kwargs)
fsspec.register_implementation("s3", CountingS3, clobber=True)

def mark():
    with open(gets, "a") as f:
        f.write("--\n")

assert rig.load(f"{url}/last", {"model": model})["step"] == 1  # the weights alone: this rank's shard
mark()
saved, now = torch.load(folder / "saved.pt"), whole()
assert all(torch.equal(now[k], saved[k]) for k in saved if k.startswith("model.")), "weights not loaded exactly"
assert rig.load(f"{url}/last", state) == {"step": 1}  # weights and moments
mark()
now = whole()
assert now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in saved), "not loaded exactly"

rig.barrier()
if rig.is_global_zero:
    fs = s3fs.S3FileSystem()
    (version,) = fs.ls(url.removeprefix("s3://") + "/ck", refresh=True)
    data = bytearray(fs.cat_file(f"{version}/__1_0.distcp"))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(f"{version}/__1_0.distcp", bytes(data))
rig.barrier()
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
before = whole()
try:
    rig.load(f"{url}/last", {"model": model})  # rank 0 reads no altered byte: rank 1 refuses for both
except torchrig.checkpoint.CheckpointError as err:
    (folder / f"refused-{rig.global_rank}.txt").write_text(str(err))
after = whole()
assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed weights"
"""
)


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.timeout(200)
def test_each_fsdp_rank_downloads_only_the_shard_objects_it_reads(bucket: str, tmp_path: Path) -> None:
    from test_checkpoint_distributed import launch

    script, _, env = _fsdp_script(tmp_path, SHARD_FETCH_SCRIPT, "fetch", bucket)
    launch("save", tmp_path, script=script, extra_env=env)
    fs = s3fs.S3FileSystem()
    (version,) = fs.ls(f"{bucket}/fetch/ck", refresh=True)
    stored = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(version, refresh=True))
    assert stored == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "state.pt"]

    launch("load", tmp_path, script=script, extra_env=env)
    common = ["last", "meta.json", "state.pt", ".metadata"]  # the link, then the version's files
    for rank in (0, 1):
        weights, everything, _ = (tmp_path / f"gets-{rank}.txt").read_text().split("--\n")
        assert sorted(weights.split()) == sorted([*common, f"__{rank}_0.distcp"]), (rank, weights)
        assert set(everything.split()) <= {*common, "__0_0.distcp", "__1_0.distcp"}, (rank, everything)
        refused = (tmp_path / f"refused-{rank}.txt").read_text()
        assert refused.startswith(f"checksum mismatch in s3://{version}/__1_0.distcp: SHA-256 is "), refused
        assert "meta.json says" in refused and "refusing to load it" in refused
