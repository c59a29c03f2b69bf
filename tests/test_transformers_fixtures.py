"""Checkpoints written by transformers 5's own ``save_pretrained`` (tests/transformers_fixtures/,
made by its make_fixtures.py with CPU torch): what was read from their ``config.json``, what
``save_pretrained`` writes is what transformers 5 wrote, and what transformers 5 read back from
mmnnx's files (its verdict, kept by check_saves.py). Their logits, greedy decoding and pipelined
training: tests/test_family_conformance.py."""

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import from_pretrained, pretrained_config, save_adapter, save_pretrained
from mmnnx.models.pretrained import CheckpointError
from mmnnx.modules import add_lora
from tests.hf_checkpoints import write_checkpoint

FIXTURES = pathlib.Path(__file__).parent / "transformers_fixtures"
NAMES = ("llama", "llama3-scaled", "qwen3", "qwen3-moe")
TOKENS = np.array(json.loads((FIXTURES / "versions.json").read_text())["tokens"], np.int32)
F32 = 1e-5  # relative to the largest logit


def _tasks(n):
    per = 8 // n
    return [
        mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=range(per * i, per * (i + 1)))) for i in range(n)
    ]


def relative_error(ours, theirs):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def _config(name):
    return json.loads((FIXTURES / name / "config.json").read_text())


def test_what_was_read():
    c = {name: pretrained_config(FIXTURES / name) for name in NAMES}
    rope = {n: c[n].block_configs[0].attention.rope for n in NAMES}
    assert [rope[n].theta for n in NAMES] == [5e5, 5e5, 1e6, 1e6]
    assert [rope[n].scaling is not None for n in NAMES] == [False, True, False, False]
    assert rope["llama3-scaled"].scaling.original_max_position_embeddings == 64
    moe = c["qwen3-moe"]
    feed_forwards = [b.feed_forward for b in moe.block_configs]
    assert [type(f).__name__ for f in feed_forwards] == ["MLPConfig", "MoEConfig"]
    assert (feed_forwards[1].num_experts, feed_forwards[1].top_k) == (4, 2)
    assert moe.router_aux_loss_coef == 0  # output_router_logits false: no load-balancing loss


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_the_rope_settings_matter_here(tmp_path, name):
    """What reading no ``rope_parameters`` (theta 10,000, transformers 4's keys) would give."""
    edited = tmp_path / name
    shutil.copytree(FIXTURES / name, edited)
    hf = _config(name)
    del hf["rope_parameters"]
    (edited / "config.json").write_text(json.dumps(hf))
    theirs = np.load(FIXTURES / name / "logits.npy")
    assert relative_error(from_pretrained(edited)(jnp.asarray(TOKENS)), theirs) > 100 * F32


def test_transformers_4_keys_read_the_same(tmp_path):
    """The scaled Llama's config in transformers 4's dialect gives the same model."""
    hf = _config("llama3-scaled")
    rope = hf.pop("rope_parameters")
    hf |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope, "torch_dtype": "float32"}
    del hf["dtype"]
    edited = tmp_path / "v4"
    shutil.copytree(FIXTURES / "llama3-scaled", edited)
    (edited / "config.json").write_text(json.dumps(hf))
    assert pretrained_config(edited) == pretrained_config(FIXTURES / "llama3-scaled")
    hf = _config("qwen3-moe")
    hf["num_experts"] = hf.pop("num_local_experts")
    shutil.copytree(FIXTURES / "qwen3-moe", tmp_path / "moe")
    (tmp_path / "moe" / "config.json").write_text(json.dumps(hf))
    assert pretrained_config(tmp_path / "moe") == pretrained_config(FIXTURES / "qwen3-moe")


@pytest.mark.parametrize("name", NAMES)
def test_a_loaded_model_is_written_back_as_transformers_wrote_it(tmp_path, name):
    model = from_pretrained(FIXTURES / name, tasks=_tasks(2), max_seq_len=32)
    same = save_pretrained(model, tmp_path / "same")
    assert json.loads((same / "config.json").read_text()) == _config(name)
    half = save_pretrained(model, tmp_path / "half", dtype=jnp.bfloat16)
    written = json.loads((half / "config.json").read_text())
    assert written == _config(name) | {"dtype": "bfloat16"}


def _verdict():
    return json.loads((FIXTURES / "verdict.json").read_text())


def test_transformers_reads_what_save_pretrained_writes(tmp_path):
    """check_saves.py loaded these configs (written by ``save_saves``) in transformers 5: the
    dtype and RoPE it read, and its logits from mmnnx's files against its own."""
    verdict = _verdict()
    written = save_saves(tmp_path)
    assert sorted(verdict["cases"]) == sorted(written)
    for case, seen in verdict["cases"].items():
        config = json.loads((written[case] / "config.json").read_text())
        assert config == seen["config"], case  # what transformers read is what is written now
        assert seen["dtype"] == config["dtype"], case
        assert seen["rope_parameters"] == config["rope_parameters"], case
        assert seen["logits_error"] < F32, case  # transformers: the same model
        assert not {"torch_dtype", "rope_theta", "rope_scaling", "num_experts"} & set(config)


def save_saves(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """The checkpoints check_saves.py gives transformers 5: each fixture loaded and re-saved in
    bfloat16, a transformers 4 checkpoint with llama3 scaling (tests/hf_checkpoints.py) and a
    Qwen3-MoE re-saved, and a model not loaded from any; beside each, ``<case>.npy``: mmnnx's
    logits for :data:`TOKENS` from the files it wrote."""
    from mmnnx.models import GPT, GPTConfig

    out = {}
    for name in NAMES:
        model = from_pretrained(FIXTURES / name)
        out[f"{name}-bf16"] = save_pretrained(model, root / f"{name}-bf16", dtype=jnp.bfloat16)
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)  # fmt: skip
    v4 = write_checkpoint(root / "sources" / "llama3", rope_scaling=scaling, shards=1)
    out["v4-llama3"] = save_pretrained(from_pretrained(v4, max_seq_len=16), root / "v4-llama3")
    v4moe = write_checkpoint(root / "sources" / "moe", architecture="Qwen3MoeForCausalLM")
    out["v4-moe"] = save_pretrained(from_pretrained(v4moe), root / "v4-moe")
    config = GPTConfig(vocab_size=128, dim=32, depth=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, gated_mlp=True, mlp_bias=False, mlp_hidden=48,
                       qk_norm=True, rope_theta=1e6, norm_eps=1e-5, max_seq_len=64)  # fmt: skip
    with nnx.use_eager_sharding(False):
        fresh = GPT(config, rngs=nnx.Rngs(0))
    qwen3 = "Qwen3ForCausalLM"
    out["fresh-qwen3"] = save_pretrained(fresh, root / "fresh-qwen3", architecture=qwen3)
    forward = nnx.jit(lambda model, tokens: model(tokens))  # eager: seconds of compiles
    for case, path in out.items():  # mmnnx's logits from the files it wrote
        np.save(root / f"{case}.npy", np.asarray(forward(from_pretrained(path), TOKENS)))
    return out


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"rope_parameters": {"rope_type": "linear"}}, "no 'factor' \\(rope_type 'linear' needs"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, 'rope_type "dynamic"'),
        ({"rope_parameters": {"type": "longrope"}}, 'rope_type "longrope"'),
    ],
)
def test_rope_types_mmnnx_does_not_compute_are_refused(tmp_path, edit, message):
    shutil.copytree(FIXTURES / "llama", tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text(json.dumps(_config("llama") | edit))
    with pytest.raises(CheckpointError, match=message) as error:
        from_pretrained(tmp_path / "c")
    text = str(error.value)
    assert f"{tmp_path / 'c'}/config.json" in text and "rope_parameters: " in text
    assert "\n" not in text


def test_the_moe_loss_follows_output_router_logits_as_transformers(tmp_path):
    """transformers adds ``router_aux_loss_coef`` times the load-balancing loss only when router
    logits are output (false in the checkpoint, its default): so does ``GPT.loss``, and the
    term equals transformers' ``aux_loss``."""
    theirs = json.loads((FIXTURES / "qwen3-moe" / "loss.json").read_text())
    assert not theirs["output_router_logits"] and not theirs["loss_by_default_has_aux"]
    loss = nnx.jit(lambda model, tokens: model.loss(tokens))  # eager: seconds of compiles
    plain = float(loss(from_pretrained(FIXTURES / "qwen3-moe"), TOKENS))
    np.testing.assert_allclose(plain, theirs["cross_entropy"], rtol=F32)
    path = tmp_path / "moe"
    shutil.copytree(FIXTURES / "qwen3-moe", path)
    hf = _config("qwen3-moe") | {"output_router_logits": True}
    (path / "config.json").write_text(json.dumps(hf))
    model = from_pretrained(path)
    assert model.config.router_aux_loss_coef == hf["router_aux_loss_coef"] == 0.001
    aux = (float(loss(model, TOKENS)) - plain) / hf["router_aux_loss_coef"]
    np.testing.assert_allclose(aux, theirs["aux_loss"], rtol=1e-3)  # float32 cancellation


ADAPTED = (*NAMES, "mistral", "mixtral", "gemma3", "deepseek_v3")
"""Every family's fixture: those check_adapters.py gave PEFT."""


def test_peft_loads_every_adapter_and_gives_the_merged_logits(tmp_path):
    """check_adapters.py loaded these adapters (written by ``save_adapters``) with PEFT onto
    transformers 5, one per family: every tensor of the file in the model, none made up, the
    logits moved and equal to mmnnx's merged export, which transformers loads with no missing
    or unexpected tensor. A dense MLP beside experts (Qwen3-MoE's ``mlp_only_layers``,
    DeepSeek-V3's first layer and shared experts) goes through ``target_parameters``: as
    ``target_modules`` PEFT puts it onto the fused experts. Mixtral's router (``block_sparse_moe``,
    transformers 4's name) is read by PEFT under transformers 5's ``mlp``."""
    from safetensors import safe_open

    verdict = json.loads((FIXTURES / "adapters_verdict.json").read_text())
    written = save_adapters(tmp_path, merged=False)
    assert sorted(verdict["cases"]) == sorted(ADAPTED)
    for name, seen in verdict["cases"].items():
        adapter = written[f"{name}-adapter"]
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["target_modules"] == seen["target_modules"], name
        assert config.get("target_parameters") == seen.get("target_parameters"), name
        with safe_open(adapter / "adapter_model.safetensors", "np") as file:
            assert len(list(file.keys())) == seen["adapter_tensors"], name
        assert seen["loaded"] == seen["adapter_tensors"] > 0, name
        assert seen["not_loaded"] == seen["lora_tensors_not_in_file"] == [], name
        assert seen["merged_missing_keys"] == seen["merged_unexpected_keys"] == [], name
        assert seen["peft_logits_error"] < F32 and seen["merged_logits_error"] < F32, name
        assert seen["adapter_moves_logits"] > 100 * F32, name
        assert seen["renamed"] == (4 if name == "mixtral" else 0), name
    cases = verdict["cases"]
    dense = ("down", "gate", "up")
    assert cases["qwen3-moe"]["target_parameters"] == [
        f"model.layers.0.mlp.{p}_proj.weight" for p in dense
    ]
    moe = cases["qwen3-moe"]
    assert moe["adapter_tensors"] == 2 * (2 * 4 + 1) + 2 * 3  # attention, router, dense MLP
    deepseek = cases["deepseek_v3"]
    assert deepseek["target_modules"] == [
        "gate", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"
    ]  # fmt: skip
    assert deepseek["target_parameters"] == [
        f"model.layers.{i}.mlp.{shared}{p}_proj.weight"
        for i, shared in ((0, ""), (1, "shared_experts."), (2, "shared_experts."))
        for p in dense
    ]
    assert "gate" in cases["mixtral"]["target_modules"]


def lora_fixture(name: str):
    """The fixture ``name`` with LoRA (rank 2, alpha 4) on every ``Linear`` ``add_lora`` adapts
    by default plus a mixture's router, its ``b`` factors random (a trained adapter, not zeros)."""
    import jax
    from flax import nnx

    from mmnnx.modules import Linear, add_lora
    from mmnnx.modules.lora import MOE_TARGETS, TARGETS

    model = from_pretrained(FIXTURES / name)
    names = {str(p[-1]) for p, m in nnx.iter_graph(model) if isinstance(m, Linear)}
    targets = tuple(t for t in TARGETS + MOE_TARGETS if t in names)
    model = add_lora(model, rank=2, alpha=4, targets=targets)
    keys = iter(jax.random.split(jax.random.key(1), 1000))
    for _, lora in nnx.iter_graph(model):
        if hasattr(lora, "b") and hasattr(lora, "a") and hasattr(lora, "rank"):
            lora.b[...] = 0.1 * jax.random.normal(next(keys), lora.b[...].shape)
    return model


def save_adapters(root: pathlib.Path, *, merged: bool = True) -> dict[str, pathlib.Path]:
    """The adapters check_adapters.py gives PEFT: each of :data:`ADAPTED` as
    :func:`lora_fixture`, written as PEFT's adapter (``<case>-adapter``,
    ``base_model_name_or_path`` the fixture) and with ``merged`` merged (``<case>-merged``),
    with mmnnx's logits of the merged model as ``<case>-merged.npy``."""
    from mmnnx.models import save_adapter

    out = {}
    for name in ADAPTED:
        model = lora_fixture(name)
        out[f"{name}-adapter"] = save_adapter(model, root / f"{name}-adapter")
        if merged:
            out[f"{name}-merged"] = path = save_pretrained(model, root / f"{name}-merged")
            logits = from_pretrained(path)(jnp.asarray(TOKENS))
            np.save(root / f"{name}-merged.npy", np.asarray(logits))
    return out


def test_rope_parameters_per_layer_type_read_for_full_attention(tmp_path):
    hf = _config("qwen3")
    hf["rope_parameters"] = {"full_attention": hf["rope_parameters"]}
    shutil.copytree(FIXTURES / "qwen3", tmp_path / "q")
    (tmp_path / "q" / "config.json").write_text(json.dumps(hf))
    assert pretrained_config(tmp_path / "q") == pretrained_config(FIXTURES / "qwen3")


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"num_local_experts": "4"}, 'num_local_experts: "4" is not an int >= 1'),
        ({"num_local_experts": None}, "no 'num_local_experts' \\(or 'num_experts'\\)"),
        ({"num_local_experts": None, "num_experts": 0}, "num_experts: 0 is not an int >= 1"),
        ({"num_experts_per_tok": 2.5}, "num_experts_per_tok: 2.5 is not an int >= 1"),
        ({"num_experts_per_tok": 8}, "num_experts_per_tok: 8 is more than num_local_experts 4"),
        ({"moe_intermediate_size": -1}, "moe_intermediate_size: -1 is not an int >= 1"),
        ({"norm_topk_prob": "yes"}, 'norm_topk_prob: "yes" is not true or false'),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step: 0 is not an int >= 1"),
        ({"mlp_only_layers": [2]}, "mlp_only_layers: \\[2\\] are not all layer indices in 0..1"),
        ({"mlp_only_layers": "0"}, 'mlp_only_layers: "0" is not a list of ints'),
        ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef: -0.1 is not a finite number >= 0"),
        ({"output_router_logits": 1}, "output_router_logits: 1 is not true or false"),
    ],
)
def test_a_qwen3_moes_own_keys_are_checked(tmp_path, edit, message):
    shutil.copytree(FIXTURES / "qwen3-moe", tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(_config("qwen3-moe") | edit))
    with pytest.raises(CheckpointError, match=message) as error:
        from_pretrained(tmp_path / "m")
    assert f"{tmp_path / 'm'}/config.json" in str(error.value)


SAMPLE = "The quick brown fox jumps over the lazy dog."
TEXT = "The quick brown fox jumps over the lazy dog. A pipeline splits a model into stages. " * 40
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}"
)


def test_transformers_loads_what_export_writes(tmp_path):
    """check_exports.py loaded the exports ``save_exports`` wrote (a fine-tuning run of the
    Llama fixture given a tokenizer, chat template and generation defaults, and a run trained
    from scratch with a BPE) in transformers 5: no missing or unexpected tensor, logits equal
    to mmnnx's, the tokenizer read by ``AutoTokenizer`` giving mmnnx's ids with the base's
    special tokens and chat template, ``GenerationConfig`` the base's eos. The small files it
    read are those mmnnx writes now (the base's, carried; a BPE's, from ``transformers_files``)."""
    from mmnnx.train.export import transformers_files

    verdict = json.loads((FIXTURES / "exports_verdict.json").read_text())
    assert sorted(verdict["cases"]) == ["finetune", "scratch"]
    for case, seen in verdict["cases"].items():
        failed = [check for check, passed in seen["checks"].items() if not passed]
        assert failed == [], (case, failed)
        assert seen["logits_error"] < F32 and seen["architecture"] == "LlamaForCausalLM", case
    finetune, scratch = verdict["cases"]["finetune"], verdict["cases"]["scratch"]
    tokenizer, generation = finetune["tokenizer"], finetune["generation"]
    assert (tokenizer["bos_token"], tokenizer["eos_token"]) == ("<s>", "</s>")
    assert tokenizer["ids_with_special_tokens"] == [1, *tokenizer["ids"]]
    assert tokenizer["chat"] == "<s>user: hi</s>"
    assert (generation["eos_token_id"], generation["temperature"]) == (2, 0.6)
    base = base_with_tokenizer(tmp_path / "base")
    for name in ("generation_config.json", "tokenizer_config.json"):
        assert finetune["files"][name] == json.loads((base / name).read_text()), name
    assert finetune["files"]["config.json"] == _config("llama")
    assert scratch["tokenizer"]["bos_token"] is scratch["generation"]["eos_token_id"] is None
    assert scratch["tokenizer"]["ids_with_special_tokens"] == scratch["tokenizer"]["ids"]
    no_special = transformers_files(json.dumps({"added_tokens": []}))
    assert {n: scratch["files"][n] for n in no_special} == no_special


def base_with_tokenizer(path: pathlib.Path, fixture: str = "llama") -> pathlib.Path:
    """The ``fixture`` (written by transformers) with what a released checkpoint has beside
    its weights: a ``tokenizer.json`` of at most its 128 tokens (``<unk>``, ``<s>``, ``</s>`` at
    0, 1, 2, as the Llama's config's bos and eos; ``<s>`` before each text),
    ``tokenizer_config.json``, ``chat_template.jinja`` and a ``generation_config.json`` of its
    own (sampling defaults)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    weights = {"config.json", "model.safetensors"}
    shutil.copytree(FIXTURES / fixture, path, ignore=lambda _, names: set(names) - weights)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    special = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=special, show_progress=False)
    tokenizer.train_from_iterator([TEXT], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    assert [tokenizer.token_to_id(t) for t in special] == [0, 1, 2]
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "clean_up_tokenization_spaces": False,
              "model_max_length": 512}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    generation = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6,
                  "top_p": 0.9, "transformers_version": "5.24.0"}  # fmt: skip
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


def save_exports(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """The exports check_exports.py gives transformers 5: ``finetune``, of 2 steps of
    ``mmnnx train --init-from`` :func:`base_with_tokenizer` over two stages, and ``scratch``,
    of 2 steps of a GPT trained from scratch with ``--gated-mlp --tokenizer bpe``; beside each,
    ``<case>.npy`` (mmnnx's logits for :data:`TOKENS` from the export) and ``<case>.json``
    (:data:`SAMPLE`, the ids the run's tokenizer gives it, and what transformers should read:
    the base's special tokens, chat template and eos)."""
    import contextlib
    import io

    from mmnnx.cli import main

    root.mkdir(parents=True, exist_ok=True)
    base = base_with_tokenizer(root / "base")
    (root / "text.txt").write_text(TEXT)
    common = ["--stages", "2", "--data-axis", "1", "--model-axis", "1", "--seq-len", "16"]
    common += ["--batch-size", "4", "--microbatches", "2", "--eval-every", "2", "--steps", "2"]
    common += ["--eval-batches", "1", "--log-every", "1", "--timeline-step", "0", "--lr", "1e-2"]
    common += ["--warmup-steps", "0", "--no-tensorboard", "--text", str(root / "text.txt")]
    scratch = ["--gated-mlp", "--tokenizer", "bpe", "--vocab-size", "300", "--dim", "32"]
    scratch += ["--depth", "2", "--heads", "2"]
    runs = {"finetune": ["--init-from", str(base)], "scratch": scratch}
    out = {}
    for case, argv in runs.items():
        run = root / "runs" / case
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["train", *common, *argv, "--output-dir", str(run)]) == 0, case
            assert main(["export", "--run", str(run), "--output", str(root / case)]) == 0, case
        out[case] = root / case
        logits = from_pretrained(out[case])(jnp.asarray(TOKENS))
        np.save(root / f"{case}.npy", np.asarray(logits))
        _write_expected(root / f"{case}.json", run, finetuned=case == "finetune")
    return out


def _write_expected(path: pathlib.Path, run: pathlib.Path, *, finetuned: bool) -> None:
    """check_exports.py's expectations of an export of ``run``: :data:`SAMPLE`, the ids the
    run's tokenizer gives it and, ``finetuned`` (from :func:`base_with_tokenizer`), the base's
    special tokens, chat template and eos."""
    from mmnnx.train import load_tokenizer

    ids = load_tokenizer(run / "tokenizer").encode(SAMPLE).tolist()
    expected = {"text": SAMPLE, "ids": ids, "bos_token": None, "eos_token": None,
                "eos_token_id": None, "chat_template": None}  # fmt: skip
    if finetuned:
        expected |= {"bos_token": "<s>", "eos_token": "</s>", "eos_token_id": 2,
                     "chat_template": CHAT_TEMPLATE}  # fmt: skip
    path.write_text(json.dumps(expected, indent=2))


EXPORTED = (
    *("llama", "qwen3", "qwen3-moe", "mistral", "mixtral", "gemma3", "deepseek_v3", "gpt-oss"),
)
"""One fixture per family: the bases of check_exports.py's and check_adapters.py's runs."""


def save_family_exports(root: pathlib.Path, families: tuple[str, ...] = EXPORTED) -> None:
    """What ``mmnnx export`` writes of each family, for check_exports.py (``root``) and
    check_adapters.py (``root/adapters``): 2 steps of ``mmnnx train --init-from``
    :func:`base_with_tokenizer` of each of :data:`EXPORTED` over two stages, whole (exported
    as ``<family>``) and with ``--lora-rank 2`` (exported merged as ``<family>-lora`` and, with
    ``--adapter``, as ``adapters/<family>-adapter``, beside ``adapters/<family>-merged``, a
    link to the merged export, and its logits); beside each export, mmnnx's logits from it
    (``.npy``) and check_exports.py's expectations (``.json``)."""
    import contextlib
    import io

    from mmnnx.cli import main

    (root / "adapters").mkdir(parents=True, exist_ok=True)
    (root / "text.txt").write_text(TEXT)
    common = ["--stages", "2", "--data-axis", "1", "--model-axis", "1", "--seq-len", "16"]
    common += ["--batch-size", "4", "--microbatches", "4", "--eval-every", "2", "--steps", "2"]
    common += ["--eval-batches", "1", "--log-every", "1", "--timeline-step", "0", "--lr", "1e-2"]
    common += ["--warmup-steps", "0", "--no-tensorboard", "--text", str(root / "text.txt")]
    for family in families:
        base = base_with_tokenizer(root / "bases" / family, family)
        for case, lora in ((family, []), (f"{family}-lora", ["--lora-rank", "2"])):
            run, out = root / "runs" / case, root / case
            with contextlib.redirect_stdout(io.StringIO()):
                argv = ["train", *common, "--init-from", str(base), *lora, "--output-dir"]
                assert main([*argv, str(run)]) == 0, case
                assert main(["export", "--run", str(run), "--output", str(out)]) == 0, case
                if lora:
                    adapter = [
                        "--adapter",
                        "--output",
                        str(root / "adapters" / f"{family}-adapter"),
                    ]
                    assert main(["export", "--run", str(run), *adapter]) == 0, case
            np.save(root / f"{case}.npy", np.asarray(from_pretrained(out)(jnp.asarray(TOKENS))))
            _write_expected(root / f"{case}.json", run, finetuned=True)
        (root / "adapters" / f"{family}-merged").symlink_to(root / f"{family}-lora")
        shutil.copy(root / f"{family}-lora.npy", root / "adapters" / f"{family}-merged.npy")


def test_a_loaded_config_has_no_flat_knob_to_misread():
    """A checkpoint's layers live in ``block_configs``: its flat per-layer knobs read ``None``,
    not a default (``rope_theta`` 10,000 for a Llama 3 of 5e5), and ``replace`` still works."""
    config = pretrained_config(FIXTURES / "llama")
    assert (config.rope_theta, config.experts, config.head_dim) == (None, None, None)
    assert config.block_configs[0].attention.rope.theta == 5e5
    assert dataclasses.replace(config, scan_layers=True).block_configs == config.block_configs


def test_yarn_frequencies_and_attention_factor_equal_transformers():
    from mmnnx.modules import YarnScaling, rope_frequencies

    for name, case in json.loads((FIXTURES / "yarn.json").read_text()).items():
        scaling = YarnScaling(**case["params"])
        ours = rope_frequencies(32, 10000.0, scaling)
        np.testing.assert_allclose(ours, case["inv_freq"], rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(scaling.attention_scale, case["attention_factor"], rtol=1e-12)


def test_a_yarn_qwen3s_settings_matter_and_are_written_back_as_they_were(tmp_path):
    """(Its logits equal transformers': tests/test_family_conformance.py.) The yarn settings
    matter at these positions: plain RoPE gives other logits."""
    path = FIXTURES / "qwen3-yarn"
    theirs = np.load(path / "logits.npy")
    plain = tmp_path / "plain"
    shutil.copytree(path, plain)
    hf = _config("qwen3-yarn")
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    (plain / "config.json").write_text(json.dumps(hf))
    assert relative_error(from_pretrained(plain)(jnp.asarray(TOKENS)), theirs) > 1e-3
    written = save_pretrained(from_pretrained(path), tmp_path / "again")
    assert json.loads((written / "config.json").read_text()) == _config("qwen3-yarn")


def test_a_qwen3_moe_in_transformers_5s_fused_layout_reads_as_the_per_expert_one(tmp_path):
    """``qwen3-moe-fused`` (make_fixtures.py ``--fused``: transformers 5's in-memory tensors,
    ``mlp.experts.gate_up_proj`` and ``down_proj``, which it loads back: its verdict) fills every
    Variable as the per-expert fixture does, so gives transformers' logits, and is written back
    in the per-expert layout, the fixture's tensors."""
    from flax import nnx
    from safetensors.numpy import load_file

    source = FIXTURES / "qwen3-moe-fused"
    verdict = json.loads((source / "fused_verdict.json").read_text())
    assert verdict["missing"] == verdict["unexpected"] == [] and verdict["logits_error"] < F32
    assert verdict["tensors"]["model.layers.1.mlp.experts.gate_up_proj"] == [4, 2 * 16, 32]
    assert not any(".experts.0." in name for name in verdict["tensors"])
    fused, per_expert = from_pretrained(source), from_pretrained(FIXTURES / "qwen3-moe")
    ours, theirs = nnx.state(fused, nnx.Param), nnx.state(per_expert, nnx.Param)
    assert jax_tree_equal(ours, theirs)
    logits = np.load(FIXTURES / "qwen3-moe" / "logits.npy")
    assert relative_error(nnx.jit(lambda m, t: m(t))(fused, jnp.asarray(TOKENS)), logits) < F32
    written = load_file(save_pretrained(fused, tmp_path / "m") / "model.safetensors")
    original = load_file(FIXTURES / "qwen3-moe" / "model.safetensors")
    assert sorted(written) == sorted(original)
    assert all(np.array_equal(written[k], original[k]) for k in original)


def jax_tree_equal(a, b) -> bool:
    import jax

    same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)
    return all(jax.tree.leaves(same))


def test_mmnnx_export_of_every_family_loads_in_transformers_and_peft():
    """check_exports.py and check_adapters.py loaded what ``mmnnx export`` wrote of 2 steps of
    ``mmnnx train --init-from`` each family (:func:`save_family_exports`, kept as
    ``family_exports_verdict.json`` and ``family_adapters_verdict.json``): the whole run and the
    LoRA run merged load in transformers as the family's architecture with no missing or
    unexpected tensor, logits equal to mmnnx's, the base's tokenizer, chat template and eos;
    the LoRA run's ``--adapter`` export loads in PEFT onto the fixture, every tensor, giving
    the merged export's logits."""
    exports = json.loads((FIXTURES / "family_exports_verdict.json").read_text())["cases"]
    adapters = json.loads((FIXTURES / "family_adapters_verdict.json").read_text())["cases"]
    assert sorted(exports) == sorted(f"{f}{lora}" for f in EXPORTED for lora in ("", "-lora"))
    assert sorted(adapters) == sorted(EXPORTED)
    for case, seen in exports.items():
        failed = [check for check, passed in seen["checks"].items() if not passed]
        assert failed == [] and seen["logits_error"] < F32, (case, failed)
        architectures = _config(case.removesuffix("-lora"))["architectures"]
        assert [seen["architecture"]] == seen["files"]["config.json"]["architectures"]
        assert [seen["architecture"]] == architectures, case
    for family, seen in adapters.items():
        assert seen["loaded"] == seen["adapter_tensors"] > 0, family
        assert seen["not_loaded"] == seen["lora_tensors_not_in_file"] == [], family
        assert seen["merged_missing_keys"] == seen["merged_unexpected_keys"] == [], family
        assert seen["peft_logits_error"] < F32 and seen["merged_logits_error"] < F32, family
        assert seen["adapter_moves_logits"] > 100 * F32, family
    # gpt-oss's experts are fused Params (transformers' too), which LoRA adapts none of: its
    # adapter holds the attention's projections alone, no target_parameters
    gpt_oss = adapters["gpt-oss"]
    assert gpt_oss["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert gpt_oss["target_parameters"] is None


ROUTERS = {"deepseek_v3": "gate", "gpt-oss": "router"}
"""The families whose router transformers 5 builds as a bare weight, not a ``Linear``, and
their router's name there."""


def _router_adapted(family: str):
    """The family's 4-layer fixture with LoRA on its routers alone, ``b`` drawn (not zero)."""
    model = add_lora(from_pretrained(FIXTURES / "deep" / family), rank=2, targets=["router"])
    for i, block in enumerate(model.blocks):
        if not hasattr(block.mlp, "router"):  # DeepSeek-V3's first, dense layer
            continue
        b = block.mlp.router.lora.b
        b[...] = 0.3 * jax.random.normal(jax.random.key(i), b.shape, b.dtype)
    return model


def save_router_adapters(root: pathlib.Path) -> None:
    """For check_adapter_probe.py (``--verdict router_adapters_verdict.json``): each of
    :data:`ROUTERS`'s adapter of :func:`_router_adapted` (``root/<family>``), beside it its
    logits of the fixture's tokens and the base it adapts."""
    for family in ROUTERS:
        model, base = _router_adapted(family), FIXTURES / "deep" / family
        out = save_adapter(model, root / family)
        tokens = np.load(base / "expected.npz")["tokens"]
        np.save(out / "logits.npy", np.asarray(model(jnp.asarray(tokens))))
        (out / "case.json").write_text(json.dumps({"base": str(base), "targets": ["router"]}))


@pytest.mark.parametrize("family", ROUTERS)
def test_a_routers_adapter_moves_the_routing_and_loads_in_peft(tmp_path, family):
    """LoRA on DeepSeek-V3's and gpt-oss's routers: it moves the logits, the merged save gives
    the adapted model's logits (DeepSeek-V3's router skipped its adapter, which the merge
    kept), and PEFT loads the adapter onto transformers with those logits (the verdict kept by
    check_adapter_probe.py of :func:`save_router_adapters`; gpt-oss's router, no ``Linear`` in
    transformers, is named in ``target_parameters``: PEFT refuses it in ``target_modules``)."""
    model = _router_adapted(family)
    tokens = jnp.asarray(np.load(FIXTURES / "deep" / family / "expected.npz")["tokens"])
    adapted = np.asarray(model(tokens))
    base = np.asarray(nnx.view(model, adapters=False)(tokens))
    assert relative_error(adapted, base) > 1e-2
    merged = from_pretrained(save_pretrained(model, tmp_path / "merged"))
    assert relative_error(merged(tokens), adapted) < F32
    config = json.loads((save_adapter(model, tmp_path / "a") / "adapter_config.json").read_text())
    verdict = json.loads((FIXTURES / "router_adapters_verdict.json").read_text())["cases"]
    assert verdict[family]["verdict"] == "ok", verdict[family]
    seen = verdict[family]["adapter_config"]
    assert seen["target_modules"] == config["target_modules"]
    assert seen.get("target_parameters") == config.get("target_parameters")
    layers = range(len(model.blocks))
    if family == "gpt-oss":
        names = [f"model.layers.{i}.mlp.router.weight" for i in layers]
        assert (config["target_modules"], config["target_parameters"]) == ([], names)
