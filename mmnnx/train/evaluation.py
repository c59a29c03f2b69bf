"""An ``lm_eval`` model of mmnnx's (registered as ``mmnnx``): lm-eval's tasks scored on a run's
model, or a Hugging Face checkpoint's, as lm-eval's own ``hf`` model scores them. Needs the
optional ``lm-eval`` (``pip install mmnnx[eval]``); imported only when asked."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from mmnnx.train.chat_template import special_tokens
from mmnnx.train.generation import stop_tokens


class UnscorableTaskError(ValueError):
    """A task asks of the run what it cannot give (a perplexity task of a run whose tokenizer has
    no beginning- or end-of-text token)."""


@register_model("mmnnx")
class MmnnxLM(TemplateLM):
    """``run=DIR`` (a run ``mmnnx train`` wrote, its newest checkpoint, ``layout`` as
    ``mmnnx generate`` takes it) or ``pretrained=DIR`` (a Hugging Face checkpoint with its
    ``tokenizer.json``); ``max_length``: the longest input (default the model's context).

    Requests are tokenized and windowed as lm-eval's ``hf`` model does (lm-eval's
    ``TemplateLM``, ``get_rolling_token_windows``): the text with the tokenizer's
    post-processor (a Llama's bos), empty contexts on the bos (else eos) token, and greedy
    generation stopped where the ``hf`` model's stops (``_generated``): at the eos ids of
    the checkpoint's generation config, where transformers' ``generate`` stops
    (``stop_tokens``: its ``generation_config.json``'s, else its ``config.json``'s), or once
    the text shows one of the request's ``until`` strings or the tokenizer's eos token (lm-eval
    adds its text to them), then decoded without special tokens and cut at those strings.

    Example::

        lm_eval --model mmnnx --model_args run=runs/sft --tasks hellaswag
        # where lm-eval runs from a process that imported mmnnx.train.evaluation
    """

    def __init__(self, run=None, pretrained=None, layout="one-device", max_length=None, **_):
        super().__init__()
        if (run is None) == (pretrained is None):
            raise ValueError("mmnnx lm_eval model: give run=DIR or pretrained=DIR")
        if run is not None:
            from mmnnx.train.generation import load_run, read_run  # noqa: PLC0415

            spec = read_run(run)
            loaded = load_run(spec, layout=layout)
            self.model, self.tokenizer = loaded.model, loaded.tokenizer
            folder, stops = spec.run.model.init_from, loaded.eos
        else:
            from mmnnx.models import from_pretrained  # noqa: PLC0415
            from mmnnx.train.tokenizers import HFTokenizer  # noqa: PLC0415

            self.model = from_pretrained(pretrained)
            self.tokenizer = HFTokenizer.from_file(pathlib.Path(pretrained, "tokenizer.json"))
            folder, stops = pretrained, stop_tokens(pretrained)
        tokens = special_tokens(folder) if folder else {}  # tokenizer_config.json, read once
        ids = {k: self.tokenizer.token_id(t) for k, t in tokens.items()}
        self._eot = ids.get("eos_token")
        self._eos = tokens.get("eos_token")  # a stop string too, as lm-eval's hf model adds it
        self._stops = stops  # where transformers' generate stops: the generation config's ids
        # decoding may end at these: the eos token's text stops it too (``_generated``)
        self._early = (*stops, *([] if self._eot is None else [self._eot]))
        self._prefix = ids.get("bos_token", self._eot)
        self._prefix_text = None if self._prefix is None else self.tokenizer.decode([self._prefix])
        self.max_length = int(max_length or self.model.config.max_seq_len)
        self._logits = nnx.jit(lambda model, tokens: model(tokens))

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        if add_special_tokens is None:  # the post-processor's, unless the text has its bos
            add_special_tokens = not (self._prefix_text and string.startswith(self._prefix_text))
        return self.tokenizer.encoding(string, add_special_tokens).ids

    def _log_probs(self, tokens: list[int]) -> np.ndarray:
        """Each position's log-probabilities, the input right-padded to ``max_length``."""
        padded = np.zeros((1, self.max_length), np.int32)
        padded[0, : len(tokens)] = tokens
        logits = self._logits(self.model, jnp.asarray(padded))[0, : len(tokens)]
        return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))

    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
        results = []
        for key, context, continuation in requests:
            inputs = (context + continuation)[-(self.max_length + 1) :][:-1]
            logp = self._log_probs(inputs)[-len(continuation) :]
            picked = logp[np.arange(len(continuation)), continuation]
            greedy = bool((logp.argmax(-1) == continuation).all())
            results.append((float(picked.sum()), greedy))
            self.cache_hook.add_partial("loglikelihood", key, results[-1])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        if self._prefix is None:  # lm-eval's own hf model fails on it too (decode(None))
            raise UnscorableTaskError(
                "a perplexity task (loglikelihood_rolling) predicts a text's first token after "
                "the tokenizer's beginning- or end-of-text token, and this run's tokenizer has "
                "neither (bos_token, eos_token); score it on loglikelihood or generation tasks"
            )
        scores = []
        for (string,) in [r.args for r in requests]:
            windows = utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            pieces = [(None, *utils.make_disjoint_window(w)) for w in windows]
            scores.append(sum(s for s, _ in self._loglikelihood_tokens(pieces)))
        return scores

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        texts = []
        for context, kwargs in [r.args for r in requests]:
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            until += [self._eos] if self._eos and self._eos not in until else []
            new = int(kwargs.get("max_gen_toks", 256))
            ids = self.tok_encode(context)[-(self.max_length - new) :]
            out = np.asarray(self.model.generate(jnp.asarray(ids), new, stop=self._early))[0]
            text = self.tokenizer.decode(self._generated(out, until), skip_special_tokens=True)
            for term in until:  # lm-eval's postprocess_generated_text
                text = text.split(term)[0] if term else text
            texts.append(text)
        return texts

    def _generated(self, new: np.ndarray, until: list[str]) -> np.ndarray:
        """The tokens of ``new`` lm-eval's ``hf`` model generates for a request: up to the
        first that is one of the generation config's eos ids, or after which the text of the
        last few (special tokens kept) shows one of ``until`` (its ``MultiTokenEOSCriteria``:
        as many as the string's own tokens and 2; the empty string shows in any), that token
        kept."""
        looks = [(s, len(self.tokenizer.encoding(s, False).ids) + 2) for s in until]
        for end, token in enumerate(new.tolist(), 1):
            if token in self._stops:
                return new[:end]
            for s, n in looks:
                text = self.tokenizer.decode(new[max(0, end - n) : end], skip_special_tokens=False)
                if s in text:
                    return new[:end]
        return new
