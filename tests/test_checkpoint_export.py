"""Export to Hugging Face safetensors: a tiny HF Llama (tied embeddings) and a tiny HF
Mixtral, trained a few steps, saved by ``fsdp_ext.Checkpointer``, exported with
``python -m fsdp_ext.checkpoint export``, loaded with ``AutoModelForCausalLM.from_pretrained``:
the same logits on a fixed batch (exact in fp32; within bf16's rounding in bf16).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import fsdp_ext
from fsdp_ext.checkpoint.__main__ import main as checkpoint_cli
from fsdp_ext.checkpoint.export import ExportConfig, export_safetensors
from tests.hf_models import TINY_DECODER

STEPS = 3


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{**TINY_DECODER, "tie_word_embeddings": tied},
        intermediate_size=64,
        num_hidden_layers=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        **TINY_DECODER,
        intermediate_size=48,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


MODELS = {"llama_tied": lambda: _llama(True), "mixtral": _mixtral}


def _batch() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))


def _trained_checkpoint(tmp_path, build):
    """A model trained STEPS steps (AdamW: optimizer state in the checkpoint too), saved
    by the Checkpointer with an extra Stateful; returns the model, its root and config dir."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    root = tmp_path / "checkpoints"
    extra = {"sched": torch.optim.lr_scheduler.StepLR(optimizer, 10)}
    ckpt = fsdp_ext.Checkpointer(str(root), model=model, optimizer=optimizer, extra=extra)
    ckpt.save(STEPS)
    ckpt.close()
    config_dir = tmp_path / "hf-config"
    model.config.save_pretrained(config_dir)
    return model.eval(), root, config_dir


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_batch()).logits.float()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_exported_model_gives_the_trained_logits(tmp_path, name):
    from transformers import AutoModelForCausalLM

    model, root, config_dir = _trained_checkpoint(tmp_path, MODELS[name])
    want = _logits(model)
    out = tmp_path / "hf"
    # the root: its newest intact checkpoint; small shards, so there are several
    argv = ["export", str(root), "--to", "safetensors", str(out), "--config", str(config_dir)]
    assert checkpoint_cli([*argv, "--max-shard-size", "20kB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).is_file() for f in files)
    assert (out / "config.json").is_file()
    # only the model's weights, under its own names: no optimizer state, no extras
    hf_names = set(model.state_dict())
    assert set(index["weight_map"]) <= hf_names
    assert not any(n.startswith(("state.", "param_groups.", "sched")) for n in index["weight_map"])

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    got = _logits(loaded)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # fp32 as stored: bit for bit

    if name == "llama_tied":
        # the tied weight once, under the name save_pretrained keeps, tied back on load
        saved = tmp_path / "save_pretrained"
        model.save_pretrained(saved)
        from safetensors import safe_open

        with safe_open(saved / "model.safetensors", "pt") as f:
            assert set(index["weight_map"]) == set(f.keys())
        assert "lm_head.weight" not in index["weight_map"]
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    else:
        assert set(index["weight_map"]) == hf_names


def test_export_in_bf16_within_its_rounding(tmp_path):
    from transformers import AutoModelForCausalLM

    model, root, config_dir = _trained_checkpoint(tmp_path, _mixtral)
    want = _logits(model)
    out = tmp_path / "hf-bf16"
    report = export_safetensors(
        str(root), str(out), ExportConfig(dtype="bf16", config=str(config_dir))
    )
    assert len(report.files) == 1 and report.left_out  # the optimizer's and the scheduler's
    from safetensors import safe_open

    (name,) = report.files
    with safe_open(out / name, "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    got = _logits(loaded)
    assert not torch.equal(got, want)  # converted
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)


def test_export_without_config_writes_every_model_tensor_and_no_optimizer_state(tmp_path):
    model, root, _ = _trained_checkpoint(tmp_path, lambda: _llama(True))
    step = root / "step-0000003"  # a checkpoint itself, named by a file:// URL
    out = tmp_path / "plain"
    report = export_safetensors(f"file://{step}", str(out))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    # without the config the ties are unknown: both names, which from_pretrained also takes
    assert set(index["weight_map"]) == set(model.state_dict())
    assert not report.tied
    assert any(".exp_avg" in k for k in report.left_out)


def test_export_reads_through_the_verified_reader(tmp_path, capsys):
    """A flipped byte in a data file stops the export, naming the file; nothing is written."""
    _, root, config_dir = _trained_checkpoint(tmp_path, lambda: _llama(False))
    step = (root / "step-0000003").resolve()
    data = sorted(p for p in step.iterdir() if p.suffix == ".distcp")
    victim = max(data, key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(raw)
    out = tmp_path / "hf"
    argv = ["export", str(step), "--to", "safetensors", str(out), "--config", str(config_dir)]
    assert checkpoint_cli(argv) == 1
    err = capsys.readouterr().err
    assert victim.name in err and "the manifest expects" in err, err
    assert not (out / "model.safetensors.index.json").exists()


def test_export_bad_input_names_the_argument(tmp_path, capsys, monkeypatch):
    _, root, config_dir = _trained_checkpoint(tmp_path, lambda: _llama(False))
    out = str(tmp_path / "o")
    base = ["export", str(root), "--to", "safetensors", out]
    with pytest.raises(SystemExit):
        checkpoint_cli([*base[:3], "onnx", out])
    with pytest.raises(SystemExit):
        checkpoint_cli([*base, "--dtype", "int4"])
    assert checkpoint_cli([*base, "--prefix", "nothing."]) == 2
    assert "no model weights under the prefix 'nothing.'" in capsys.readouterr().err
    monkeypatch.chdir(config_dir)  # a relative path to the file itself is fine
    assert checkpoint_cli([*base, "--config", "config.json", "--max-shard-size", "1MB"]) == 0
    assert checkpoint_cli([*base, "--config", str(tmp_path)]) == 2
    assert "no config.json there" in capsys.readouterr().err
    assert checkpoint_cli(["export", str(tmp_path / "none"), "--to", "safetensors", out]) == 2
    assert checkpoint_cli(["export", "s3://bucket/x", "--to", "safetensors", out]) == 2
    assert "only local checkpoints" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dtype must be one of"):
        ExportConfig(dtype="int8")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        ExportConfig(max_shard_bytes=0)


@pytest.mark.slow  # ~25 s on a loaded 2-core box: a fresh interpreter imports torch
def test_export_runs_as_a_module(tmp_path):
    _, root, config_dir = _trained_checkpoint(tmp_path, lambda: _llama(False))
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "fsdp_ext.checkpoint", "export", str(root), "--to",
           "safetensors", str(out), "--config", str(config_dir / "config.json")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "exported" in done.stdout and (out / "config.json").is_file()


# ------------------------------------------------ trained sharded, through the accelerate adapter

WORLD = 2


def _adapter_run(root: str, config_dir: str, name: str) -> dict:
    """2 ranks: the model sharded by fsdp_ext.integrations.accelerate.prepare (FSDP2), a few
    AdamW steps, saved by the Checkpointer; the logits of the sharded model on the batch."""
    import torch.distributed as dist
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState

    from fsdp_ext.integrations.accelerate import keep_fsdp_on_cpu, prepare
    from tests.hf_models import set_launch_env

    set_launch_env(WORLD)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    keep_fsdp_on_cpu(accelerator, plugin)
    model = MODELS[name]()
    if dist.get_rank() == 0:
        model.config.save_pretrained(config_dir)
    model, optimizer, _ = prepare(
        accelerator, model, lambda params: torch.optim.AdamW(params, lr=1e-2)
    )
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank())
        tokens = torch.randint(0, 64, (2, 12), generator=g)
        accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()
    ckpt = fsdp_ext.Checkpointer(root, model=model, optimizer=optimizer)
    ckpt.save(STEPS)
    ckpt.close()
    model.eval()
    logits = _logits(model)
    AcceleratorState._reset_state(reset_partial_state=True)
    return {"logits": logits}


@pytest.mark.parametrize(  # ~50 s and ~35 s on the loaded 2-core box
    "name", ["llama_tied", pytest.param("mixtral", marks=pytest.mark.slow)]
)
def test_trained_through_the_accelerate_adapter_exports_the_same_logits(
    tmp_path, monkeypatch, name
):
    pytest.importorskip("accelerate")
    # the plugin has no mesh, so the units shard over a default one: CPU's here (see
    # test_integrations_accelerate.py's edges test)
    monkeypatch.setenv("FSDP_EXT_DEFAULT_MESH_ON_CUDA", "0")
    from transformers import AutoModelForCausalLM

    from fsdp_ext.testing import run_distributed

    root, config_dir = str(tmp_path / "checkpoints"), str(tmp_path / "hf-config")
    runs = run_distributed(_adapter_run, WORLD, root, config_dir, name, timeout=300)
    out = tmp_path / "hf"
    argv = ["export", root, "--to", "safetensors", str(out), "--config", config_dir]
    assert checkpoint_cli(argv) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(loaded), runs[0]["logits"], rtol=1e-5, atol=1e-5)


def test_export_to_an_s3_location(tmp_path, s3_env):
    from transformers import AutoModelForCausalLM

    from fsdp_ext.checkpoint import blob_store_for

    model, root, config_dir = _trained_checkpoint(tmp_path, lambda: _llama(True))
    out = f"s3://{s3_env.bucket}/export-{tmp_path.name}"
    argv = ["export", str(root), "--to", "safetensors", out, "--config", str(config_dir)]
    assert checkpoint_cli([*argv, "--max-shard-size", "20kB"]) == 0
    store = blob_store_for(out)
    index = json.loads(store.get("model.safetensors.index.json"))
    local = tmp_path / "downloaded"
    for key in store.list():
        (local / key).parent.mkdir(parents=True, exist_ok=True)
        (local / key).write_bytes(store.get(key))
    assert set(index["weight_map"].values()) < set(store.list())
    loaded = AutoModelForCausalLM.from_pretrained(local).eval()
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)
