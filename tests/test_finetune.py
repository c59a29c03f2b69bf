"""Fine-tuning a Hugging Face checkpoint: `mmnnx train --init-from` (whole, or LoRA adapters only)
over two stages, `mmnnx generate` with the checkpoint's tokenizer, `mmnnx export` as a Hugging
Face checkpoint or PEFT adapters; against a float64 numpy reference (tests/hf_reference.py), the
safetensors files themselves and one device."""

import contextlib
import io
import json
import pathlib
import shutil
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from tokenizers import Tokenizer

import mmnnx as mm
from mmnnx.cli import main
from mmnnx.models import from_pretrained
from mmnnx.models.pretrained.files import CheckpointFiles
from mmnnx.modules import add_lora
from mmnnx.modules.lora import LoRA
from mmnnx.train import Checkpointer, HFTokenizer, TextDataset, load_tokenizer, write_config
from mmnnx.train.generation import load_run
from mmnnx.train.loop import TrainConfig, loss_and_grads
from mmnnx.train.run_config import resolved_config
from mmnnx.train.tokenizers import ByteTokenizer
from tests.hf_checkpoints import write_checkpoint
from tests.hf_reference import reference_logits

TEXT = "The quick brown fox jumps over the lazy dog. A pipeline splits a model into stages. " * 60
TOKENS = np.array([[3, 17, 250, 9, 101, 77, 5, 42], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)

LLAMA_LINEARS = ("q", "k", "v", "out", "gate", "up", "down")  # what add_lora adapts in a Llama

# jitted: eager, each operation of a model's forward compiled on its own took seconds
logits_of = nnx.jit(lambda model, tokens: model(tokens))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    (root / "text.txt").write_text(TEXT)
    write_checkpoint(root / "llama", architecture="LlamaForCausalLM", num_hidden_layers=2)
    return root


def train(root, run, *argv):
    """`mmnnx train --init-from` the tiny Llama in this process, its output swallowed."""
    base = ["train", "--init-from", str(root / "llama"), "--stages", "2", "--data-axis", "1"]
    base += ["--seq-len", "16", "--batch-size", "4", "--microbatches", "2", "--eval-every", "2"]
    base += ["--eval-batches", "1", "--log-every", "1", "--timeline-step", "0", "--lr", "1e-2"]
    base += ["--warmup-steps", "0", "--no-tensorboard", "--text", str(root / "text.txt")]
    with contextlib.redirect_stdout(io.StringIO()):
        return main([*base, "--output-dir", str(root / run), *argv])


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(root):
    """Every weight trained, stacked blocks, tensor-parallel over 2 devices in each stage."""
    assert train(root, "full", "--steps", "4", "--model-axis", "2", "--scan-layers") == 0
    return root / "full"


@pytest.fixture(scope="module")
def lora_run(root):
    """Adapters of rank 4 on every projection, 2 stages of one device, saved at steps 2 and 4."""
    argv = ["--steps", "4", "--model-axis", "1", "--lora-rank", "4", "--lora-alpha", "8"]
    assert train(root, "lora", *argv, "--checkpoint-every", "2") == 0
    return root / "lora"


def cross_entropy(logits, targets):
    logits = logits - logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return float(-np.take_along_axis(logp, targets[..., None], axis=-1).mean())


def test_full_fine_tuning_starts_at_the_reference_loss_and_lowers_it(root, full_run):
    rows = metrics(full_run)
    tokenizer = load_tokenizer(full_run / "tokenizer")
    assert isinstance(tokenizer, HFTokenizer)
    dataset = TextDataset.from_files(
        root / "text.txt", tokenizer, full_run / "data", seq_len=16, batch_size=4, seed=0
    )
    batch = next(dataset)  # the run's first batch
    expected = cross_entropy(reference_logits(root / "llama", batch[:, :-1]), batch[:, 1:])
    first = next(r for r in rows if r["step"] == 1)
    assert abs(first["loss"] - expected) <= 1e-4, (first["loss"], expected)
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < evals[0] - 0.1, evals
    saved = tomllib.loads((full_run / "config.toml").read_text())
    assert saved["model"]["init_from"] == str(root / "llama")
    assert not {"dim", "depth", "heads", "gated_mlp"} & set(saved["model"])  # the checkpoint's
    assert "tokenizer" not in saved["training"] and "vocab_size" not in saved["training"]


def _plain_params(model):
    """Every ``nnx.Param`` that is not an adapter, by path."""
    return {
        p: np.asarray(v)
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if "lora" not in p
    }


def test_lora_trains_the_adapters_only(root, lora_run):
    run = load_run(lora_run)
    fresh = from_pretrained(root / "llama", max_seq_len=16)
    trained, base = _plain_params(run.model), _plain_params(fresh)
    assert trained.keys() == base.keys() and len(base) == 2 * 9 + 3
    for path, value in base.items():
        np.testing.assert_array_equal(trained[path], value, err_msg=str(path))  # bit-identical
    start = add_lora(fresh, rank=4, alpha=8.0, seed=0)  # the adapters the run began with
    for layer in range(2):
        for name in LLAMA_LINEARS:
            group = "attn" if name in ("q", "k", "v", "out") else "mlp"
            now = getattr(getattr(run.model.blocks[layer], group), name).lora
            then = getattr(getattr(start.blocks[layer], group), name).lora
            assert now.scale == 2.0
            assert not np.array_equal(np.asarray(now.a[...]), np.asarray(then.a[...]))
            assert np.abs(np.asarray(now.b[...])).max() > 0  # from zeros
    opt = ocp.StandardCheckpointer().restore(lora_run / "checkpoints" / "4" / "opt")
    adapters = {
        "/".join(map(str, p)): v.shape
        for p, v in nnx.to_flat_state(nnx.state(run.model, nnx.LoRAParam))
    }
    assert len(adapters) == 2 * len(LLAMA_LINEARS) * 2
    held = {}
    for path, leaf in jax.tree.leaves_with_path(opt):
        keys = [str(k.key) for k in path]  # opt_state/0/mu/blocks/0/attn/q/lora/a, ...
        moment = next((k for k in keys if k in ("mu", "nu")), None)
        if moment is None:
            assert leaf.shape == (), keys  # the step counts
            continue
        held.setdefault(moment, {})["/".join(keys[keys.index(moment) + 1 :])] = leaf.shape
    assert sorted(held) == ["mu", "nu"]
    for moments in held.values():
        assert moments == adapters  # adapter-shaped, one per adapter: nothing of the kernels


def test_a_resumed_lora_run_continues_as_a_straight_one(root, lora_run):
    parts = root / "lora-parts"
    shutil.copytree(lora_run, parts)
    shutil.rmtree(parts / "checkpoints" / "4")  # as if it had stopped after step 2
    assert train(root, "lora-parts", "--steps", "4", "--resume") == 0
    straight, resumed = metrics(lora_run), metrics(parts)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    for a, b in zip(straight, resumed, strict=True):
        a.pop("tokens_per_s", None), b.pop("tokens_per_s", None)
        assert a == b  # losses to the last bit
    for item in ("model", "opt"):
        a = ocp.StandardCheckpointer().restore(lora_run / "checkpoints" / "4" / item)
        b = ocp.StandardCheckpointer().restore(parts / "checkpoints" / "4" / item)
        flat_a, flat_b = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
        assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
        for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def _tasks(n):
    return [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(n)]


def _with_random_b(model, seed):
    """``model`` with every adapter's ``b`` drawn at random (a fresh one is zeros, which
    leaves ``a`` without gradient), each on its own devices."""
    adapters = [m for _, m in nnx.iter_graph(model) if isinstance(m, LoRA)]
    for i, lora in enumerate(adapters):
        value = lora.b.get_value()
        new = 0.05 * jax.random.normal(jax.random.key(seed + i), value.shape, value.dtype)
        lora.b.set_value(jax.device_put(new, value.sharding))
    return model


def test_a_lora_step_over_two_stages_equals_one_device(root):
    path = root / "llama"
    placed = _with_random_b(
        add_lora(from_pretrained(path, tasks=_tasks(2), max_seq_len=16), rank=4), 7
    )
    one = _with_random_b(add_lora(from_pretrained(path, max_seq_len=16), rank=4), 7)
    batch = jnp.asarray(np.concatenate([TOKENS, TOKENS[::-1]])[:, :9] % 300)
    pipelined = TrainConfig(microbatches=2, schedule="1f1b")
    loss, grads = mm.jit(loss_and_grads(pipelined, nnx.LoRAParam))(placed, batch)
    reference = nnx.jit(loss_and_grads(TrainConfig(microbatches=1), nnx.LoRAParam))  # eager: slow
    ref_loss, ref_grads = reference(one, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    flat, ref_flat = nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)
    assert [p for p, _ in flat] == [p for p, _ in ref_flat]
    assert {p[-1] for p, _ in flat} == {"a", "b"} and len(flat) == 2 * len(LLAMA_LINEARS) * 2
    for (p, g), (_, r) in zip(flat, ref_flat, strict=True):
        g, r = np.asarray(g[...]), np.asarray(r[...])
        assert np.abs(r).max() > 0, p
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max(), err_msg=str(p))


def export(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["export", *argv])
    return status, out.getvalue()


def test_merged_export_loads_back_with_the_trained_logits(root, lora_run):
    status, said = export("--run", str(lora_run), "--output", str(root / "merged"))
    assert status == 0 and "LlamaForCausalLM, from step 4" in said
    merged = from_pretrained(root / "merged")
    trained = load_run(lora_run).model
    ours, theirs = np.asarray(logits_of(merged, TOKENS)), np.asarray(logits_of(trained, TOKENS))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())
    for name in ("tokenizer.json", "generation_config.json"):  # the base's, not a scratch one
        assert (root / "merged" / name).read_bytes() == (root / "llama" / name).read_bytes()
    assert not (root / "merged" / "tokenizer_config.json").exists()  # the base has none
    status, said = export(
        "--run", str(lora_run), "--output", str(root / "half"), "--step", "2", "--dtype", "bfloat16"
    )
    assert status == 0 and "from step 2" in said
    files = CheckpointFiles(root / "half")
    assert {info.dtype for info in files.tensors.values()} == {"BF16"}
    assert json.loads((root / "half" / "config.json").read_text())["dtype"] == "bfloat16"


def test_adapter_export_is_pefts_layout_and_merges_to_the_merged_export(root, lora_run):
    merged = root / "merged-again"
    assert export("--run", str(lora_run), "--output", str(merged), "--merge-lora")[0] == 0
    out = root / "adapter"
    assert export("--run", str(lora_run), "--output", str(out), "--adapter")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["base_model_name_or_path"] == str(root / "llama")
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert sorted(config["target_modules"]) == sorted(names)
    adapter, base, result = (
        CheckpointFiles(out),
        CheckpointFiles(root / "llama"),
        CheckpointFiles(merged),
    )
    assert len(adapter.tensors) == 2 * len(names) * 2
    for layer in range(2):
        for name in names:
            group = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            weight = f"model.layers.{layer}.{group}.{name}.weight"
            stem = f"base_model.model.model.layers.{layer}.{group}.{name}"
            w = base.read(weight).astype(np.float64)
            a = adapter.read(f"{stem}.lora_A.weight").astype(np.float64)
            b = adapter.read(f"{stem}.lora_B.weight").astype(np.float64)
            assert a.shape == (4, w.shape[1]) and b.shape == (w.shape[0], 4)  # (r, in), (out, r)
            np.testing.assert_allclose(
                w + (8.0 / 4) * b @ a, result.read(weight), rtol=1e-6, atol=1e-6, err_msg=weight
            )


def test_generate_reads_and_writes_with_the_checkpoints_tokenizer(root, full_run):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert (
            main(
                [
                    "generate",
                    "--run",
                    str(full_run),
                    "--prompt",
                    "The quick",
                    "--max-new-tokens",
                    "4",
                ]
            )
            == 0
        )
    hf = Tokenizer.from_file(str(root / "llama" / "tokenizer.json"))
    prompt = hf.encode("The quick", add_special_tokens=False).ids
    model = load_run(full_run).model
    new = np.asarray(model.generate(jnp.asarray(prompt), 4))[0].tolist()
    assert out.getvalue() == hf.decode(prompt + new, skip_special_tokens=False) + "\n"
    assert len(prompt) < len("The quick")  # merged tokens: not bytes


def test_the_checkpoints_tokenizer_reads_plain_text_and_is_saved_with_a_run(root, tmp_path):
    tokenizer = HFTokenizer.from_file(root / "llama" / "tokenizer.json")
    hf = Tokenizer.from_file(str(root / "llama" / "tokenizer.json"))
    text = "Hello, world! The quick brown fox."
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and ids.tolist() == hf.encode(text, add_special_tokens=False).ids
    bos = hf.token_to_id("<|begin_of_text|>")
    assert hf.encode(text).ids == [bos, *ids.tolist()]  # the post-processor's BOS: left out
    assert tokenizer.decode(ids) == text and tokenizer.decode([bos]) == "<|begin_of_text|>"
    assert tokenizer.vocab_size == hf.get_vocab_size(with_added_tokens=True) == 376
    tokenizer.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert isinstance(again, HFTokenizer) and again.to_str() == tokenizer.to_str()
    with pytest.raises(FileNotFoundError, match="no such tokenizer file"):
        HFTokenizer.from_file(tmp_path / "none.json")


def _edit_config(root, name, **changes):
    target = root / name
    if not target.exists():
        shutil.copytree(root / "llama", target)
        config = json.loads((target / "config.json").read_text())
        config.update(changes)
        (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--dim", "64"], "--dim conflicts with --init-from"),
        (["--depth", "2"], "--depth conflicts with --init-from"),
        (["--heads", "4"], "--heads conflicts with --init-from"),
        (["--gated-mlp"], "--gated-mlp conflicts with --init-from"),
        (["--tokenizer", "bpe"], "--tokenizer conflicts with --init-from"),
        (["--vocab-size", "300"], "--vocab-size conflicts with --init-from"),
        (["--experts", "4"], "--experts conflicts with --init-from"),
        (["--expert-axis", "2"], "--expert-axis 2 needs --experts E"),
        (
            ["--stages", "4", "--data-axis", "1"],
            "num_hidden_layers 2 gives fewer blocks than --stages 4",
        ),
        (
            ["--partition", "2,1"],
            "--partition 2,1 gives 3 blocks, but the model has 2 (--init-from's num_hidden_layers",
        ),
        (["--lora-alpha", "4"], "--lora-alpha needs --lora-rank R"),
        (["--lora-targets", "q,v"], "--lora-targets needs --lora-rank R"),
        (  # found before anything is read but config.json (issue 69 f)
            ["--lora-rank", "2", "--lora-targets", "q,router"],
            "--lora-targets router: {root}/llama has no mixture of experts (--experts); its "
            "projections are q,k,v,out,gate,up,down",
        ),
    ],
)
def test_bad_fine_tuning_flags_exit_2_in_one_line(root, capsys, argv, reason):
    assert main(["train", "--init-from", str(root / "llama"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mmnnx train: error: "), err
    assert reason.format(root=root) in err, err


def test_a_tied_head_counts_as_a_stage_for_the_schedule_before_anything_is_written(
    tmp_path, capsys
):
    # the head tied to the embedding brings the forward pass back to stage 0 (3 stages on 2
    # tasks): 2 microbatches were accepted, then the step raised MPMDError (exit 1) after the
    # run directory was made
    source = write_checkpoint(tmp_path / "qwen3", architecture="Qwen3ForCausalLM", tied=True)
    out = tmp_path / "run"
    argv = ["--stages", "2", "--microbatches", "2", "--data-axis", "1", "--model-axis", "1"]
    assert main(["train", "--init-from", str(source), "--output-dir", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs at least as many microbatches as stages (3)" in err
    assert "3 stages on 2 tasks" in err and not out.exists()


def test_bad_init_from_directories_exit_2_in_one_line(root, tmp_path, capsys):
    falcon = _edit_config(root, "falcon", architectures=["FalconForCausalLM"])
    no_tokenizer = _edit_config(root, "no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink(missing_ok=True)
    sentencepiece = _edit_config(root, "sentencepiece")  # said "does not exist", no way out
    (sentencepiece / "tokenizer.json").unlink(missing_ok=True)
    (sentencepiece / "tokenizer.model").write_bytes(b"")
    small = _edit_config(root, "small-vocabulary", vocab_size=300)
    config = tmp_path / "sizes.toml"
    config.write_text("[model]\ndepth = 2\n")
    for argv, reason in [
        (["--init-from", str(falcon)], "FalconForCausalLM is not supported; mmnnx builds"),
        (["--init-from", str(root / "none")], "no such checkpoint directory"),
        (["--init-from", str(no_tokenizer)], "tokenizer.json does not exist"),
        (
            ["--init-from", str(sentencepiece)],
            f"AutoTokenizer.from_pretrained('{sentencepiece}').save_pretrained(",
        ),
        (["--init-from", str(small)], "has 376 tokens, more than the model's vocab_size 300"),
        (["--init-from", str(root / "llama"), "--config", str(config)], "--depth conflicts"),
        (
            ["--init-from", str(root / "llama"), "--model-axis", "4", "--data-axis", "1"],
            "--init-from's num_key_value_heads 2 is not divisible by --model-axis 4",
        ),
    ]:
        assert main(["train", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mmnnx train: error: --"), err
        assert reason in err, err
    with pytest.raises(SystemExit) as info:
        main(
            [
                "train",
                "--init-from",
                str(root / "llama"),
                "--lora-rank",
                "2",
                "--lora-targets",
                "q,o",
            ]
        )
    assert info.value.code == 2
    choices = "q, q_a, q_b, k, v, kv_a, kv_b, out, gate, up, down, router"
    assert f"--lora-targets: 'o' is not one of {choices}" in capsys.readouterr().err


def test_tensors_that_do_not_fit_exit_2_before_the_run_writes_anything(root, tmp_path, capsys):
    # the tensors were once checked only when the model was read, after the run had made its
    # checkpoints/ and tokenized its text into OUTPUT_DIR/data
    from safetensors.numpy import load_file, save_file

    for name, edit, reason in [
        ("no-up", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing tensor"),
        (
            "wide-up",
            lambda t: t.update({"model.layers.1.mlp.up_proj.weight": np.zeros((3, 3), "f4")}),
            "tensor 'model.layers.1.mlp.up_proj.weight' has shape (3, 3)",
        ),
    ]:
        bad = _edit_config(root, name)
        index = json.loads((bad / "model.safetensors.index.json").read_text())
        file = bad / index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
        tensors = load_file(file)
        edit(tensors)
        save_file(tensors, file, metadata={"format": "pt"})
        held = index["weight_map"].items()
        index["weight_map"] = {k: f for k, f in held if f != file.name or k in tensors}
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
        out = tmp_path / name
        assert main(["train", "--init-from", str(bad), "--output-dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and reason in err, err
        assert not out.exists()


def _scratch_run(tmp_path, name, tokenizer=None, **flags):
    """A run directory as `mmnnx train` leaves it (config, ``tokenizer`` (default: bytes), one
    checkpoint) for a GPT trained from scratch with ``flags``, its model's weights random."""
    from mmnnx.train.config import RunConfig
    from mmnnx.train.run_model import build_model, model_config

    run = tmp_path / name
    tokenizer = tokenizer or ByteTokenizer()
    values = dict(dim=32, depth=2, heads=2, seq_len=16, stages=2, data_axis=1, model_axis=1)
    values.update(devices=8, output_dir=str(run), tokenizer=tokenizer.name, **flags)
    write_config(run / "config.toml", resolved_config(values))
    tokenizer.save(run / "tokenizer")
    config = RunConfig.of(values)
    model = build_model(config, model_config(config, tokenizer.vocab_size))
    with Checkpointer(run / "checkpoints") as ckpt:
        ckpt.save(3, model=model, extra={"step": 3})
    return run, model


def test_a_run_from_scratch_exports_as_llama_when_its_gpt_is_one(tmp_path, capsys):
    run, model = _scratch_run(tmp_path, "gated", gated_mlp=True)
    status, said = export("--run", str(run), "--output", str(tmp_path / "hf"))
    assert status == 0 and "LlamaForCausalLM, from step 3" in said
    again = from_pretrained(tmp_path / "hf")
    mlp = again.config.block_configs[0].feed_forward
    assert mlp.gated and not mlp.bias and again.config.vocab_size == 256
    tokens = jnp.asarray(TOKENS % 256)
    np.testing.assert_allclose(
        np.asarray(logits_of(again, tokens)),
        np.asarray(logits_of(model, tokens)),
        rtol=1e-5,
        atol=1e-5,
    )
    # issue 69: transformers' generation defaults; bytes have no tokenizer.json to configure
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {}
    assert not {"tokenizer.json", "tokenizer_config.json"} & {
        p.name for p in (tmp_path / "hf").iterdir()
    }
    plain, _ = _scratch_run(tmp_path, "plain")
    status = main(["export", "--run", str(plain), "--output", str(tmp_path / "no")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    blockers = "an ungated GELU MLP (LlamaForCausalLM: SiLU-gated) and MLP biases"
    assert f"LlamaForCausalLM cannot hold {blockers}" in err
    assert "train with --gated-mlp" in err and not (tmp_path / "no").exists()
    # issue 69: a gated MoE run was told to use --gated-mlp, which it had, and not which
    # family stops at what
    moe, _ = _scratch_run(tmp_path, "moe-gated", gated_mlp=True, experts=4, moe_every=2)
    assert main(["export", "--run", str(moe), "--output", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "LlamaForCausalLM cannot hold mixture-of-experts blocks" in err, err
    assert "Qwen3MoeForCausalLM cannot hold no query/key norms" in err, err
    assert "MixtralForCausalLM cannot hold dense feed-forward layers" in err, err
    assert "--gated-mlp" not in err and not (tmp_path / "no").exists()
    every, _ = _scratch_run(tmp_path, "moe-every", gated_mlp=True, experts=4)  # Mixtral's shape
    assert main(["export", "--run", str(every), "--output", str(tmp_path / "mixtral")]) == 0
    config = json.loads((tmp_path / "mixtral" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]


def test_a_bpe_run_from_scratch_exports_what_transformers_reads_its_tokenizer_with(tmp_path):
    """Issue 69: beside the run's BPE as ``tokenizer.json``, a ``tokenizer_config.json`` naming
    the class that reads it as it is (its decoding spaces untouched) and transformers' minimal
    ``generation_config.json``: the BPE has no bos or eos, so neither names one (check_exports.py
    read these in transformers 5)."""
    from mmnnx.train.tokenizers import BPETokenizer

    bpe = BPETokenizer.train([TEXT], vocab_size=300)
    run, _ = _scratch_run(tmp_path, "bpe", tokenizer=bpe, gated_mlp=True, vocab_size=300)
    assert export("--run", str(run), "--output", str(tmp_path / "hf"))[0] == 0
    out = tmp_path / "hf"
    assert (out / "tokenizer.json").read_text() == bpe.to_str()
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    assert json.loads((out / "generation_config.json").read_text()) == {}
    assert not (out / "special_tokens_map.json").exists()


def test_the_bos_and_eos_a_tokenizer_json_names_are_written():
    from mmnnx.train.export import transformers_files

    added = [{"id": 9, "content": "<|begin_of_text|>", "special": True},
             {"id": 10, "content": "<|end_of_text|>", "special": True},
             {"id": 11, "content": "</s>", "special": False}]  # fmt: skip
    files = transformers_files(json.dumps({"added_tokens": added}))
    assert files["generation_config.json"] == {"bos_token_id": 9, "eos_token_id": 10}
    config = files["tokenizer_config.json"]
    assert (config["bos_token"], config["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")
    with pytest.raises(ValueError, match="tokenizer.json is not a JSON object") as error:
        transformers_files("[1, 2")
    assert "\n" not in str(error.value)


def test_a_run_with_lora_on_the_router_generates(tmp_path, capsys):
    """Issue 69 (a): ``lora_targets = "q,v,router"`` in config.toml is read as the flag reads
    it, three names, not each character."""
    targets = ("q", "v", "router")
    run, _ = _scratch_run(tmp_path, "moe", experts=4, lora_rank=2, lora_targets=targets)
    assert 'lora_targets = "q,v,router"' in (run / "config.toml").read_text()
    model = load_run(run).model
    assert {str(p[-2]) for p, m in nnx.iter_graph(model) if isinstance(m, LoRA)} == set(targets)
    argv = ["generate", "--run", str(run), "--prompt", "ab", "--max-new-tokens", "2"]
    assert main(argv) == 0, capsys.readouterr().err


def test_bad_exports_exit_2_in_one_line(root, full_run, capsys):
    cases = [
        (["--adapter"], "--adapter: the run in"),
        (["--merge-lora"], "--merge-lora: the run in"),
        (["--adapter", "--merge-lora"], "--merge-lora and --adapter exclude each other"),
        (["--adapter", "--quantized"], "--quantized and --adapter exclude each other"),
        (["--quantized"], "read from no quantized checkpoint (its config.json has no quantiz"),
        (["--step", "3"], "no checkpoint of step 3 in"),
    ]
    for argv, reason in cases:
        out = root / "not-written"
        assert main(["export", "--run", str(full_run), "--output", str(out), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mmnnx export: error: "), err
        assert reason in err, err
        assert not out.exists()
    (root / "exists").mkdir(exist_ok=True)
    assert main(["export", "--run", str(full_run), "--output", str(root / "exists")]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    (root / "a-file").write_text("")  # issue 69: a place that cannot be written: a traceback
    assert main(["export", "--run", str(full_run), "--output", str(root / "a-file" / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a-file/o: cannot write there (Not a directory)" in err, err


def test_an_export_never_overwrites_a_run_or_its_base_even_with_overwrite(root, full_run, capsys):
    # issue 69: `export --run R --output R --overwrite` replaced the run with the export
    config = tomllib.loads((full_run / "config.toml").read_text())
    base = pathlib.Path(config["model"]["init_from"])
    before = sorted(p.relative_to(full_run) for p in full_run.rglob("*"))
    cases = [
        (full_run, "would overwrite the run ("),
        (full_run / "exported", "would overwrite the run ("),
        (full_run / "checkpoints", "would overwrite the run's checkpoints"),
        (full_run.parent, "would overwrite the run ("),
        (base, "would overwrite the run's --init-from checkpoint"),
    ]
    for output, said in cases:
        argv = ["export", "--run", str(full_run), "--output", str(output), "--overwrite"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    other = root / "another-run"
    (other / "checkpoints").mkdir(parents=True, exist_ok=True)
    (other / "config.toml").write_text("")
    assert main(["export", "--run", str(full_run), "--output", str(other), "--overwrite"]) == 2
    assert "holds a run (config.toml and checkpoints/)" in capsys.readouterr().err
    # another run below OUT, or OUT inside another run (its checkpoints/): --overwrite deleted it
    (other / "checkpoints" / "4").mkdir(exist_ok=True)
    holder = root / "holder"
    (holder / "kept").mkdir(parents=True, exist_ok=True)
    (holder / "kept" / "config.toml").write_text("")
    (holder / "kept" / "checkpoints").mkdir(exist_ok=True)
    cases = [
        (holder, "holds another run"),
        (other / "checkpoints", "lies inside another run"),
        (other / "exported", "lies inside another run"),
    ]
    for output, said in cases:
        argv = ["export", "--run", str(full_run), "--output", str(output), "--overwrite"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    assert (other / "checkpoints" / "4").is_dir() and (holder / "kept" / "config.toml").is_file()
    assert not (other / "exported").exists()
    assert sorted(p.relative_to(full_run) for p in full_run.rglob("*")) == before
    assert (base / "config.json").is_file()


def test_a_run_refuses_a_base_checkpoint_changed_since_it_trained(tmp_path, capsys):
    # issue 69: a fine-tuning run recorded only its --init-from path; an edited config.json
    # (every shape kept) was used without a word by --resume, generate and export
    base = tmp_path / "base"
    write_checkpoint(base, architecture="LlamaForCausalLM", num_hidden_layers=2)
    (tmp_path / "text.txt").write_text(TEXT)
    argv = ["train", "--init-from", str(base), "--stages", "2", "--data-axis", "1",
            "--model-axis", "1", "--seq-len", "16", "--batch-size", "4", "--microbatches", "2",
            "--eval-every", "2", "--eval-batches", "1", "--timeline-step", "0",
            "--no-tensorboard", "--text", str(tmp_path / "text.txt"), "--steps", "2",
            "--output-dir", str(tmp_path / "run")]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    config = json.loads((base / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (base / "config.json").write_text(json.dumps(config))
    said = "changed since the run was trained from it (checkpoint step 2 records it): its "
    said += "config.json has rms_norm_eps = 0.001, the run was trained from 1e-05"
    run = str(tmp_path / "run")
    commands = [
        [*argv[:-2], "--output-dir", run, "--resume", "--steps", "3"],
        ["generate", "--run", run, "--prompt", "The", "--max-new-tokens", "2"],
        ["export", "--run", run, "--output", str(tmp_path / "out")],
    ]
    for command in commands:
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(command) == 2, command[0]
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
