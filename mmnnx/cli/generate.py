"""``mmnnx generate``: continue a prompt with the model of a run ``mmnnx train`` wrote."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from typing import Any

from mmnnx.cli import prologue
from mmnnx.cli.flags import add_fields, typed
from mmnnx.train.options import finite, integer, option, positive, switch


@dataclasses.dataclass
class Options:
    run: str = option(dataclasses.MISSING, "the run's --output-dir", metavar="DIR")
    prompt: str = option(dataclasses.MISSING, "the text to continue", metavar="TEXT")
    max_new_tokens: int | None = option(
        None,
        "tokens to add (default: as many as the model's context, --seq-len, has room for)",
        positive,
        metavar="N",
    )
    temperature: float = option(
        0.0,
        "0 picks the likeliest token (greedy, the default); above 0, sample from the "
        "logits divided by T",
        finite(positive=False),
        metavar="T",
    )
    top_k: int | None = option(
        None, "with --temperature, sample among the K likeliest tokens only", positive, metavar="K"
    )
    seed: int = option(0, "sampling seed (0)", integer(0), metavar="S")
    chat: bool = switch(
        "--chat",
        "PROMPT is a user's message: rendered with the chat template of the run's --init-from "
        "checkpoint, the assistant's reply printed (up to the same eos tokens)",
    )
    layout: str = option(
        "one-device",
        "one-device (default), or run: the run's own --stages x --data-axis x "
        "--model-axis tasks, each stage's blocks and their cache on its submesh (mm.jit)",
        choices=("one-device", "run"),
    )


def add_parser(commands: Any) -> None:
    generate = commands.add_parser(
        "generate",
        help="continue a prompt with the model of a run `mmnnx train` wrote",
        description="Rebuild the model of run directory DIR from DIR/config.toml, restore its "
        "newest checkpoint, and print PROMPT followed by its continuation (decoded with "
        "DIR/tokenizer), up to the first eos token of its --init-from checkpoint, where "
        "transformers' generate stops: any id of its generation_config.json's eos_token_id (an "
        "id or a list; none if it has none), else (no such file) of its config.json's. Each "
        "token is one step of a compiled decoder with a key/value cache; greedy unless "
        "--temperature is given. Example: "
        'mmnnx generate --run runs/demo --prompt "In the beginning"',
    )
    add_fields(generate, dataclasses.fields(Options))


def run(args: argparse.Namespace) -> int:
    """``mmnnx generate``: the prompt continued on stdout; status 2 and one line if it cannot."""
    options, error = typed(Options, args), functools.partial(prologue.error, "generate")
    if not options.prompt:
        return error("--prompt is empty; give some text to continue")
    spec, problem = prologue.run_spec(options.run)
    if problem:
        return error(problem)
    from mmnnx.train.generation import (  # noqa: PLC0415
        RunError,
        continue_text,
        load_run,
        reply_text,
    )

    prompt = options.prompt
    if options.chat:
        from mmnnx.train.chat_template import ChatTemplate  # noqa: PLC0415

        base = spec.run.model.init_from
        if base is None:
            return error(
                "--chat: the run was trained from scratch; its tokenizer has no chat template"
            )
        try:
            template = ChatTemplate.from_checkpoint(base)
            message = [{"role": "user", "content": prompt}]
            prompt = template.render(message, add_generation_prompt=True)[0]
        except (OSError, ValueError) as e:
            return error(f"--chat: {e}")
    try:  # a byte of argv that is not UTF-8 is a lone surrogate here
        prompt_tokens = len(spec.tokenizer.encode(prompt))
    except ValueError as e:
        return error(f"--prompt is {e}")
    try:
        run = load_run(spec, layout=options.layout)
    except (RunError, *prologue.unrestorable()) as e:
        return error(f"--run: {e}")
    context = run.model.config.max_seq_len
    room, new = context - prompt_tokens, options.max_new_tokens
    if room < 1:
        return error(
            f"--prompt is {prompt_tokens} tokens; the model reads at most {context} (its "
            "--seq-len), leaving no room to continue"
        )
    if new is not None and new > room:
        return error(
            f"--max-new-tokens {new} exceeds the {room} tokens the model's --seq-len {context} "
            f"leaves after a {prompt_tokens}-token prompt"
        )
    skipped = "".join(f"; {s}" for s in run.skipped)  # newer steps that are damaged
    print(
        f"mmnnx generate: {options.run}, step {run.step}, layout {options.layout}{skipped}",
        file=sys.stderr,
    )
    write = reply_text if options.chat else continue_text
    text = write(
        run.model,
        run.tokenizer,
        prompt,
        new or room,
        eos=run.eos,
        temperature=options.temperature,
        top_k=options.top_k,
        seed=options.seed,
    )
    print(text)
    return 0
