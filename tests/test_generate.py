"""Generation: the key/value-cached decoder equals recomputing the whole sequence, the run's
layout (mm.jit over tasks) equals one device, and `mmnnx generate` continues a prompt with a
trained run's model."""

import contextlib
import io
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.cli import main
from mmnnx.models import GPT, GPTConfig
from mmnnx.models.decoding import _ONE_DEVICE, _forward, generate
from mmnnx.models.stages import stage_rules
from mmnnx.modules import RopeScaling
from mmnnx.train.generation import run_tasks
from tests.test_cli import damage

SMALL = dict(dim=32, depth=2, num_heads=2, vocab_size=64, max_seq_len=16)


logits_of = nnx.jit(lambda model, tokens: model(tokens))


def one_device(config: GPTConfig) -> GPT:
    with nnx.use_eager_sharding(False):
        return GPT(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_cache_gives_the_logits_of_the_whole_sequence(scan_layers):
    model = one_device(GPTConfig(**SMALL, num_kv_heads=1, scan_layers=scan_layers))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
    # jitted (the cache as generate reads it): eager, each operation compiled on its own
    whole = logits_of(model, tokens)  # (2, 12, 64): no cache, every position recomputed
    logits, cache = _ONE_DEVICE(model, tokens[:, :5], None, jnp.int32(0))
    np.testing.assert_allclose(logits, whole[:, 4], rtol=1e-5, atol=1e-5)
    for pos in range(5, 12):
        logits, cache = _ONE_DEVICE(model, tokens[:, pos : pos + 1], cache, jnp.int32(pos))
        np.testing.assert_allclose(logits, whole[:, pos], rtol=1e-5, atol=1e-5)
    # greedy: each token is the argmax of recomputing the prompt and the tokens so far
    new = generate(model, tokens[:, :4], 8)
    sequence = jnp.concatenate([tokens[:, :4], new], axis=1)
    np.testing.assert_array_equal(new, jnp.argmax(logits_of(model, sequence[:, :-1])[:, 3:], -1))


KNOBS = dict(
    num_kv_heads=1,
    head_dim=24,  # 2 * 24 != 32
    qk_norm=True,
    rope_theta=1e6,
    rope_scaling=RopeScaling(
        factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0, original_max_position_embeddings=8
    ),
    norm_eps=1e-5,
    mlp_hidden=40,
    mlp_bias=False,
    gated_mlp=True,
)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_cache_reads_the_llama_qwen3_knobs(scan_layers):
    model = one_device(GPTConfig(**SMALL, **KNOBS, scan_layers=scan_layers))
    for path, v in nnx.iter_graph(model):  # q/k norm scales away from ones: norms that matter
        if isinstance(v, nnx.Param) and ("q_norm" in path or "k_norm" in path):
            v.set_value(1 + 0.5 * jax.random.normal(jax.random.key(len(path)), v.shape))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
    whole = logits_of(model, tokens)  # jitted, as above
    logits, cache = _ONE_DEVICE(model, tokens[:, :5], None, jnp.int32(0))
    np.testing.assert_allclose(logits, whole[:, 4], rtol=1e-5, atol=1e-5)
    for pos in range(5, 12):
        logits, cache = _ONE_DEVICE(model, tokens[:, pos : pos + 1], cache, jnp.int32(pos))
        np.testing.assert_allclose(logits, whole[:, pos], rtol=1e-5, atol=1e-5)
    # greedy: each new token is the argmax of the whole sequence so far, recomputed each step
    new = generate(model, tokens[:, :4], 10)
    padded = nnx.jit(lambda m, t: m(t))  # one shape: positions after p do not change p's logits
    sequence = jnp.zeros((2, 16), jnp.int32).at[:, :4].set(tokens[:, :4])
    for step in range(10):
        expected = jnp.argmax(padded(model, sequence)[:, 3 + step], axis=-1)
        np.testing.assert_array_equal(new[:, step], expected)
        sequence = sequence.at[:, 4 + step].set(expected)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_generating_on_the_run_layout_equals_one_device(scan_layers):
    config = GPTConfig(**SMALL, scan_layers=scan_layers)
    tasks = run_tasks(2, 2, 2)  # two stages of 2 x 2 devices, heads and vocab over "model"

    def factory():
        return GPT(config, rngs=nnx.Rngs(0))

    with nnx.use_eager_sharding(False):
        placement = stage_rules(nnx.eval_shape(factory), tasks, report=False)
    placed = mm.init(factory, placement)
    single = one_device(config)
    prompt = jnp.array([3, 4, 5, 6])
    np.testing.assert_array_equal(placed.generate(prompt, 8), single.generate(prompt, 8))
    stop = [int(single.generate(prompt, 8)[0, 3])]  # ends there: each token read back
    stopped = placed.generate(prompt, 8, stop=stop)
    np.testing.assert_array_equal(stopped, single.generate(prompt, 8, stop=stop))
    assert stopped.shape[1] <= 4
    key = jax.random.key(7)
    np.testing.assert_array_equal(
        placed.generate(prompt, 8, temperature=0.9, top_k=8, rng=key),
        single.generate(prompt, 8, temperature=0.9, top_k=8, rng=key),
    )
    if not scan_layers:  # each block's cache lives on its block's task
        _, cache = mm.jit(_forward)(placed, prompt[None], None, jnp.int32(0))
        for (keys, values), task in zip(cache, tasks, strict=True):
            devices = {int(d) for d in task.mesh.devices.flat}
            assert {d.id for d in keys.sharding.device_set} == devices
            assert {d.id for d in values.sharding.device_set} == devices


def test_sampling_follows_temperature_top_k_and_key():
    model = one_device(GPTConfig(**SMALL))
    prompt = jnp.array([1, 2])
    a = model.generate(prompt, 10, temperature=1.0, rng=jax.random.key(1))
    assert (a == model.generate(prompt, 10, temperature=1.0, rng=jax.random.key(1))).all()
    assert (a != model.generate(prompt, 10, temperature=1.0, rng=jax.random.key(2))).any()
    top1 = model.generate(prompt, 10, temperature=1.0, top_k=1, rng=jax.random.key(3))
    np.testing.assert_array_equal(top1, model.generate(prompt, 10))  # top-1 is greedy


def test_sampling_at_a_tiny_temperature_takes_the_likeliest_token():
    """Logits of +-100 divided by 2e-38 (a normal float32) overflow to +-inf, where every draw
    among the +inf ones is a tie; measured from the likeliest logit they cannot."""
    model = one_device(GPTConfig(**SMALL))
    model.head.kernel[...] = model.head.kernel[...] * 1000
    prompt = jnp.array([1, 2])
    hot = model.generate(prompt, 6, temperature=2e-38, rng=jax.random.key(1))
    np.testing.assert_array_equal(hot, model.generate(prompt, 6))


@pytest.mark.parametrize(
    "prompt, new, options, reason",
    [
        ([], 4, {}, "the prompt must be a non-empty"),
        ([1, 2], 0, {}, "max_new_tokens must be >= 1, got 0"),
        ([1] * 10, 7, {}, "a prompt of 10 tokens plus max_new_tokens 7 exceeds the model's"),
        ([1, 2], 4, {"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ([1, 2], 4, {"temperature": 1.0, "top_k": 0}, "top_k must be >= 1, got 0"),
    ],
)
def test_bad_requests_raise_before_running(prompt, new, options, reason):
    model = one_device(GPTConfig(**SMALL))
    with pytest.raises(ValueError, match=reason):
        model.generate(jnp.array(prompt, jnp.int32), new, **options)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny run of `mmnnx train` (4 steps), in this process, and what it printed."""
    tmp = tmp_path_factory.mktemp("generate")
    text = tmp / "text.txt"
    text.write_text("In the beginning the quick brown fox jumps over the lazy dog. " * 300)
    run = tmp / "run"
    argv = ["train", "--dim", "32", "--depth", "2", "--heads", "2", "--seq-len", "24"]
    argv += ["--batch-size", "8", "--microbatches", "2", "--steps", "4", "--eval-every", "4"]
    argv += ["--timeline-step", "0", "--text", str(text), "--output-dir", str(run)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return run, printed.getvalue()


def test_a_run_ends_with_a_sample(trained_run):
    run, printed = trained_run
    *_, title, sample, end = printed.split("\n")
    assert title == f'sample (greedy; more: mmnnx generate --run {run} --prompt "...")'
    assert sample.startswith("In the beginning") and end == ""
    assert len(sample.encode()) <= 24  # the prompt's 16 bytes and 8 more: --seq-len 24


def test_generate_continues_prompts_on_one_device_and_on_the_layout(trained_run, capsys):
    trained_run, _ = trained_run
    argv = ["generate", "--run", str(trained_run), "--prompt", "In the"]
    assert main([*argv, "--max-new-tokens", "10"]) == 0
    one = capsys.readouterr()
    assert one.err == f"mmnnx generate: {trained_run}, step 4, layout one-device\n"
    text = one.out.removesuffix("\n")
    assert text.startswith("In the") and len(text.encode()) <= len("In the") + 10
    assert main([*argv, "--max-new-tokens", "10", "--layout", "run"]) == 0
    assert capsys.readouterr().out == one.out  # the run's 2 stages x 2 x 2 give the same text
    assert main(argv) == 0  # by default, up to the model's context (--seq-len 24)
    assert len(capsys.readouterr().out.removesuffix("\n").encode()) <= 24


def test_a_temperature_too_small_for_float32_is_greedy(trained_run, capsys):
    """1e-50 is 0 in float32 and 1e-40 subnormal (flushed to 0 on a device): both drew among
    infinite logits (NUL bytes) before; now greedy."""
    trained_run, _ = trained_run
    argv = ["generate", "--run", str(trained_run), "--prompt", "In the", "--max-new-tokens", "8"]
    assert main([*argv, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    for temperature in ("1e-50", "1e-40"):
        assert main([*argv, "--temperature", temperature]) == 0
        assert capsys.readouterr().out == greedy, temperature


def test_a_prompt_byte_that_is_not_utf8_is_that_byte_on_a_bytes_run(trained_run, capsys):
    """`--prompt $'the \\xff'`: Python's argv holds the byte as '\\udcff'; the bytes tokenizer
    encodes it back to 255 (it was a UnicodeEncodeError traceback)."""
    trained_run, _ = trained_run
    argv = ["generate", "--run", str(trained_run), "--max-new-tokens", "4", "--prompt"]
    assert main([*argv, "the \udcff"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the \ufffd"), out  # the byte, printed as UTF-8 shows one


def test_under_mmnnx_launch_it_says_it_runs_in_one_process(trained_run, capsys, monkeypatch):
    # each process of `mmnnx launch -n 2 --devices-per-process 4 -- mmnnx generate` said the run
    # needs 8 devices of its 4, not that generate does not join the processes
    monkeypatch.setenv("MMNNX_NUM_PROCESSES", "2")
    assert main(["generate", "--run", str(trained_run[0]), "--prompt", "In"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs in one process, not as one of the 2 of mmnnx" in err


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "x" * 24], "--prompt is 24 tokens; the model reads at most 24"),
        (["--prompt", "In", "--max-new-tokens", "23"], "--max-new-tokens 23 exceeds the 22"),
    ],
)
def test_prompts_the_model_cannot_take_exit_2_in_one_line(trained_run, capsys, argv, reason):
    trained_run, _ = trained_run
    assert main(["generate", "--run", str(trained_run), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and reason in err, err


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--top-k", "0"], "--top-k must be >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--layout", "wide"], "invalid choice: 'wide'"),
    ],
)
def test_bad_generate_flags_exit_2_in_one_line(capsys, argv, reason):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--run", "runs/none", "--prompt", "In", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and reason in err, err


def test_a_directory_without_a_run_exits_2_in_one_line(trained_run, tmp_path, capsys):
    trained_run, _ = trained_run
    assert main(["generate", "--run", str(tmp_path), "--prompt", "In"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"mmnnx generate: error: --run: {tmp_path / 'config.toml'}: no such file; is {tmp_path} "
        "a directory `mmnnx train` wrote?\n"
    )
    (tmp_path / "config.toml").write_text((trained_run / "config.toml").read_text())
    assert main(["generate", "--run", str(tmp_path), "--prompt", "In"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no saved tokenizer in" in err, err
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text('{"name": "bytes"}')
    text = (trained_run / "config.toml").read_text().replace(str(trained_run), str(tmp_path))
    (tmp_path / "config.toml").write_text(text)
    assert main(["generate", "--run", str(tmp_path), "--prompt", "In"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint in" in err, err


def test_generate_passes_over_damaged_steps_naming_them_in_one_line(
    trained_run, tmp_path, capsys, stray_errors
):
    trained_run, _ = trained_run
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    config = (run / "config.toml").read_text().replace(str(trained_run), str(run))
    (run / "config.toml").write_text(config)
    ckpt = run / "checkpoints"
    shutil.copytree(ckpt / "4", ckpt / "2")  # an older step, intact
    damaged = damage(ckpt / "4")
    argv = ["generate", "--run", str(run), "--prompt", "In", "--max-new-tokens", "2"]
    assert main(argv) == 0
    assert capsys.readouterr().err == (
        f"mmnnx generate: {run}, step 2, layout one-device; skipped step 4: damaged ({damaged} "
        "cannot be read)\n"
    )
    damage(ckpt / "2")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # nothing else: no Orbax or asyncio traceback
    assert err.startswith(
        f"mmnnx generate: error: --run: no readable checkpoint in {ckpt}: skipped step 4: "
        f"damaged ({damaged} cannot be read); skipped step 2: damaged ("
    ), err


def metaspace_tokenizer():
    """A tokenizer.json as Llama 2's and Mistral's are (a '▁' prepended, spaces as '▁', the
    decoder stripping the first space): '<s>[INST] hi' decodes as '<s> [INST] hi'."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers  # noqa: PLC0415

    from mmnnx.train.tokenizers import HFTokenizer  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + [decoders.Strip(" ", 1, 0)]
    )
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special, show_progress=False)
    tokenizer.train_from_iterator(["[INST] what is the time [/INST] it is late"] * 4, trainer)
    return HFTokenizer(tokenizer)


def test_a_chat_reply_is_its_new_tokens_up_to_eos_whatever_the_prompt_decodes_to():
    """`mmnnx generate --chat` printed the whole text decoded minus len(prompt) characters:
    a Metaspace tokenizer decodes '<s>[INST] hi [/INST]' with one more space, so the reply
    began with the prompt's last ']' (and lost its last character to the cut)."""
    from mmnnx.train.generation import reply_text  # noqa: PLC0415

    tokenizer = metaspace_tokenizer()
    prompt = "<s>[INST] what is the time [/INST]"
    assert tokenizer.decode(tokenizer.encode(prompt)) != prompt  # the trap
    config = {**SMALL, "vocab_size": tokenizer.vocab_size, "max_seq_len": 32}
    model = one_device(GPTConfig(**config))
    new = np.asarray(model.generate(tokenizer.encode(prompt), 8))[0].tolist()
    assert reply_text(model, tokenizer, prompt, 8) == tokenizer.decode(new)
    eos = tokenizer._model.id_to_token(new[3])
    cut = new[: new.index(new[3])]  # up to the first time that token comes
    assert reply_text(model, tokenizer, prompt, 8, eos=eos) == tokenizer.decode(cut)


def test_a_continuation_stops_at_the_eos_token_of_the_runs_base(tmp_path, capsys):
    """`mmnnx generate` without --chat printed all its tokens, past the eos token of the run's
    --init-from checkpoint (transformers' generate stops there, and so did --chat)."""
    from mmnnx.train.generation import continue_text, read_run  # noqa: PLC0415
    from mmnnx.train.tokenizers import HFTokenizer  # noqa: PLC0415
    from tests.hf_checkpoints import write_checkpoint  # noqa: PLC0415

    tokenizer = metaspace_tokenizer()
    prompt = "what is the time"
    config = {**SMALL, "vocab_size": tokenizer.vocab_size, "max_seq_len": 32}
    model = one_device(GPTConfig(**config))
    ids = tokenizer.encode(prompt).tolist()
    new = np.asarray(model.generate(np.asarray(ids), 8))[0].tolist()
    eos = tokenizer._model.id_to_token(new[3])
    cut = new[: new.index(new[3])]  # up to the first time that token comes
    assert continue_text(model, tokenizer, prompt, 8, eos=eos) == tokenizer.decode(ids + cut)
    assert continue_text(model, tokenizer, prompt, 8) == tokenizer.decode(ids + new)
    # the eos a run generates up to: its base's, as --chat reads it
    base = write_checkpoint(tmp_path / "base", num_hidden_layers=1)
    (base / "tokenizer_config.json").write_text('{"eos_token": {"content": "</s>"}}')
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text(f'[model]\ninit_from = "{base}"\n')
    HFTokenizer.from_file(base / "tokenizer.json").save(run / "tokenizer")
    generation = json.loads((base / "generation_config.json").read_text())
    assert read_run(run).eos == (generation["eos_token_id"],)  # where transformers stops
    (base / "generation_config.json").unlink()  # none: config.json's, not the eos_token
    config = json.loads((base / "config.json").read_text())
    assert read_run(run).eos == (config["eos_token_id"],)
    (base / "tokenizer_config.json").write_text("{")  # not read for the eos ids
    assert read_run(run).eos == (config["eos_token_id"],)
    (base / "tokenizer_config.json").write_text("{}")  # and no chat template
    assert main(["generate", "--run", str(run), "--prompt", "hi", "--chat"]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and "--data-format" not in err  # a flag of train's
    (base / "generation_config.json").write_text('{"eos_token_id": "</s>"}')
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id \['</s>'\] is"):
        read_run(run)


def eos_checkpoint(folder):
    """tests/transformers_fixtures/eos/'s checkpoint in ``folder/base`` (put together as
    make_eos_fixtures.assemble does) and what transformers generates on it."""
    fixtures = pathlib.Path(__file__).parent / "transformers_fixtures"
    base = folder / "base"
    base.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(fixtures / "llama" / name, base)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(fixtures / "eos" / name, base)
    return base, json.loads((fixtures / "eos" / "expected.json").read_text())


def test_generation_stops_at_any_eos_id_of_the_bases_generation_config(tmp_path):
    """`mmnnx generate` (plain and --chat) stopped only at tokenizer_config.json's eos_token;
    transformers' generate stops at any id of generation_config.json's eos_token_id (Llama 3
    Instruct lists [128001, 128008, 128009]: a turn ends at <|eot_id|>, not its eos_token).
    On a checkpoint listing [2, 3, 83], greedy decoding reaches 83 (<|eot_id|>; the eos_token
    is 2) and transformers stops there (make_eos_fixtures.py): so does mmnnx."""
    from mmnnx.models import from_pretrained  # noqa: PLC0415
    from mmnnx.train.generation import continue_text, read_run, reply_text  # noqa: PLC0415
    from mmnnx.train.tokenizers import HFTokenizer  # noqa: PLC0415

    base, expected = eos_checkpoint(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text(f'[model]\ninit_from = "{base}"\n')
    HFTokenizer.from_file(base / "tokenizer.json").save(run / "tokenizer")
    spec, model = read_run(run), from_pretrained(base)
    assert spec.eos == tuple(expected["eos_token_id"])
    tokenizer, prompt, n = spec.tokenizer, expected["prompt"], expected["max_new_tokens"]
    assert tokenizer.encode(prompt).tolist() == expected["prompt_ids"]
    *reply, stop = expected["generated"]
    assert tokenizer.decode([stop]) == "<|eot_id|>" != tokenizer.decode([2])  # not eos_token
    assert continue_text(model, tokenizer, prompt, n, eos=spec.eos) == expected["text"]
    assert reply_text(model, tokenizer, prompt, n, eos=spec.eos) == tokenizer.decode(reply)
    # every token of the greedy run, stopped nowhere: the one mmnnx printed
    unstopped = tokenizer.decode(expected["prompt_ids"] + expected["without_stop"])
    assert continue_text(model, tokenizer, prompt, n) == unstopped


EOS_CASES = json.loads(
    (pathlib.Path(__file__).parent / "transformers_fixtures" / "eos" / "cases.json").read_text()
)
"""make_eos_fixtures.py's record of where transformers stops on variations of eos/'s checkpoint
(and lm-eval's hf model's replies on them: tests/test_evaluation.py)."""


def eos_variant(folder, case):
    """eos_checkpoint with the files of one of cases.json's cases (make_eos_fixtures.variant):
    its generation_config.json (None: none), config.json's eos_token_id and the eos_token."""
    folder.mkdir()
    base, expected = eos_checkpoint(folder)
    (base / "generation_config.json").unlink()
    if case["generation_config"] is not None:
        (base / "generation_config.json").write_text(json.dumps(case["generation_config"]))
    for name, key, value in [
        ("config.json", "eos_token_id", case["config_eos_token_id"]),
        ("tokenizer_config.json", "eos_token", case["eos_token"]),
    ]:
        content = json.loads((base / name).read_text())
        (base / name).write_text(json.dumps(content | {key: value}))
    return base, expected


def as_tuple(ids):
    """transformers' generation config's eos_token_id (None, an id or a list) as a tuple."""
    return () if ids is None else tuple(ids) if isinstance(ids, list) else (ids,)


def test_stop_tokens_are_where_transformers_generate_stops(tmp_path):
    """Without generation_config.json transformers stops at config.json's eos_token_id (it
    builds the generation config from it), and with one that has no eos_token_id nowhere;
    never at tokenizer_config.json's eos_token, where mmnnx stopped in both cases. Each case of
    cases.json: stop_tokens is transformers' eos ids, and mmnnx's greedy tokens, decoding ended
    at every row's first stop token (GPT.generate's stop), are transformers' generate's."""
    from mmnnx.models import from_pretrained  # noqa: PLC0415
    from mmnnx.train.generation import continue_text, stop_tokens  # noqa: PLC0415
    from mmnnx.train.tokenizers import HFTokenizer  # noqa: PLC0415

    model = tokenizer = None
    for i, case in enumerate(EOS_CASES["cases"]):
        base, expected = eos_variant(tmp_path / str(i), case)
        stops = stop_tokens(base)
        assert stops == as_tuple(case["stops_at"]), case["name"]
        if model is None:  # the weights are the same in every case
            model = from_pretrained(base)
            tokenizer = HFTokenizer.from_file(base / "tokenizer.json")
        ids, n = expected["prompt_ids"], expected["max_new_tokens"]
        new = np.asarray(model.generate(np.asarray(ids), n, stop=stops))[0].tolist()
        assert new == case["generated"], case["name"]  # shorter where it stopped
        *text, last = case["generated"]
        text += [] if last in stops else [last]  # the stop token is not printed
        text = tokenizer.decode(ids + text)
        assert continue_text(model, tokenizer, expected["prompt"], n, eos=stops) == text


def test_stop_tokens_of_a_multimodal_config_are_its_text_configs(tmp_path):
    """A multimodal Gemma 3 without generation_config.json: transformers stops at the eos ids
    of config.json's text_config (transformers writes none at its top), or at the top-level
    ones where it has them (from_model_config); mmnnx read its tokenizer_config.json (none)."""
    from mmnnx.train.generation import stop_tokens, until_eos  # noqa: PLC0415
    from mmnnx.train.tokenizers import ByteTokenizer  # noqa: PLC0415

    multimodal = EOS_CASES["multimodal"]
    for case in ("text_config", "top_level"):
        recorded = multimodal[case]
        base = tmp_path / case
        base.mkdir()
        (base / "config.json").write_text(json.dumps(recorded["config"]))
        stops = stop_tokens(base)
        assert stops == as_tuple(recorded["stops_at"]) and stops, case
        unstopped = np.array(multimodal["without_stop"])
        assert until_eos(unstopped, ByteTokenizer(), stops).tolist() == recorded["generated"][:-1]
    assert multimodal["text_config"]["config"].get("eos_token_id") is None


def test_stop_tokens_name_a_config_json_that_is_not_one(tmp_path):
    from mmnnx.train.generation import stop_tokens  # noqa: PLC0415

    assert stop_tokens(tmp_path) == ()  # no file
    config = tmp_path / "config.json"
    config.write_text("{")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON \(Expecting"):
        stop_tokens(tmp_path)
    config.write_text("[1]")
    with pytest.raises(ValueError, match=r"config.json: not a JSON object"):
        stop_tokens(tmp_path)
    config.write_text('{"eos_token_id": null, "text_config": {"eos_token_id": ["</s>"]}}')
    with pytest.raises(ValueError, match=r"config.json: eos_token_id \['</s>'\] is not a token"):
        stop_tokens(tmp_path)
    config.write_text('{"eos_token_id": 5, "text_config": {"eos_token_id": [1, 106]}}')
    assert stop_tokens(tmp_path) == (5,)  # the top level's first
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match=r"generation_config.json: not valid JSON"):
        stop_tokens(tmp_path)


def test_decoding_ends_once_every_row_has_stopped():
    """GPT.generate computed every one of max_new_tokens before the eos cut them; with stop
    ids it ends at the step where each row has generated one, its tokens up to there those
    of a run without them."""
    model = one_device(GPTConfig(**SMALL))
    prompt = jnp.array([[1, 2, 3], [4, 5, 6]])
    full = np.asarray(model.generate(prompt, 10))
    stop = [int(full[0, 2]), int(full[1, 5])]  # a token of each row
    end = max(np.isin(row, stop).argmax() for row in full) + 1  # the step the last row stops
    assert end < 10
    stopped = np.asarray(model.generate(prompt, 10, stop=stop))
    np.testing.assert_array_equal(stopped, full[:, :end])
    assert all(np.isin(row, stop).any() for row in stopped)
    np.testing.assert_array_equal(model.generate(prompt, 10, stop=[64 + 1]), full)  # none
    np.testing.assert_array_equal(model.generate(prompt, 10, stop=stop[:1]), full)  # one row


def test_a_fine_tuned_runs_sample_stops_where_generate_stops(tmp_path, capsys, monkeypatch):
    """The sample `mmnnx train` prints at the end of a run passed no eos: a fine-tuned run's
    went on past its base's eos ids, where `mmnnx generate` and transformers stop."""
    from mmnnx.cli import train as train_cli  # noqa: PLC0415
    from mmnnx.models import from_pretrained  # noqa: PLC0415
    from mmnnx.train.config import RunConfig  # noqa: PLC0415
    from mmnnx.train.tokenizers import HFTokenizer  # noqa: PLC0415

    base, expected = eos_checkpoint(tmp_path)
    model, tokenizer = from_pretrained(base), HFTokenizer.from_file(base / "tokenizer.json")
    monkeypatch.setattr(train_cli, "SAMPLE_PROMPT", expected["prompt"])
    config = RunConfig.of({"init_from": str(base), "output_dir": str(tmp_path / "run")})
    assert train_cli._sample(model, tokenizer, config) == 0
    assert capsys.readouterr().out.splitlines()[-1] == expected["text"]
    (base / "generation_config.json").write_text("{")
    assert train_cli._sample(model, tokenizer, config) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("sample: none (--init-from: ") and "generation_config.json" in line
