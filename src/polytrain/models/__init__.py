"""Reference models, selectable by name, and the task each one learns."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..data import DEFAULT_DATASET
from ..errors import ConfigError, unknown
from .gpt import GPT
from .gpt_moe import GPTMoEOptions, gpt_moe, resolved_options
from .mlp import MLP
from .wordlm import WordLM, WordLMOptions

__all__ = ["GPT", "MLP", "WordLM", "ModelSpec", "register_model", "get_model", "model_names",
           "seq_len_of", "SIZE_OPTIONS"]

#: The size options every model may take, each a flag of its own (``--seq-len``); a model's
#: other options are the fields of its ``options`` class.
SIZE_OPTIONS = ("seq_len", "d_model", "layers", "heads")


def _next_token(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return window[:, :-1], window[:, 1:]


def _next_byte(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return window[:, :-1], window[:, -1]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: logits (..., vocab), targets (...)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _whole_window(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return window, window[:, 1:]  # the model needs the targets: its softmax is sampled


def _mean(losses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return losses.mean()


def _words(model: nn.Module) -> torch.Tensor:
    from ..data.words import words_corpus

    vocab = model.vocab
    assert isinstance(vocab, int)
    return words_corpus(vocab)


@dataclass(frozen=True)
class ModelSpec:
    """A named model: how to build it, and how a window of data becomes (inputs, targets).

    ``options``: a frozen dataclass whose fields are more keyword options of
    ``build`` (the CLI makes a flag of each, as for strategy options).
    ``corpus``: the token ids the model trains on, given the model (default: the
    run's ``--data``, bytes).
    ``resolve``: every option (as :meth:`full_options` fills them) with the values the
    model gives those left None (gpt-moe: its gate's defaults).
    """

    name: str
    build: Callable[..., nn.Module]
    split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    description: str
    options: type | None = None
    corpus: Callable[[nn.Module], torch.Tensor] | None = None
    resolve: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None

    def make(self, **options: Any) -> nn.Module:
        """Build the model; options it does not take are refused by name."""
        params = inspect.signature(self.build).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            unknown = sorted(set(options) - set(params))
            if unknown:  # as flags: the CLI's names (a script's are the same with _)
                own = {f.name for f in dataclasses.fields(self.options)} if self.options else set()
                flags = ", ".join("--" + n.replace("_", "-") for n in params
                                  if n in SIZE_OPTIONS or n in own)
                raise ConfigError(f"model {self.name!r} takes no option "
                                  f"{', '.join('--' + n.replace('_', '-') for n in unknown)}",
                                  f"its options are: {flags}")
        return self.build(**options)

    def full_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` with every option the model takes and was not given at its default,
        and those left None at the value the model gives them (:attr:`resolve`): two runs
        of the same model compare equal however their options were spelled."""
        defaults = {n: p.default for n, p in inspect.signature(self.build).parameters.items()
                    if p.default is not p.empty}
        full = {**defaults, **options}
        return self.resolve(full) if self.resolve is not None else full

    def check_data(self, data: str) -> None:
        """Refuse a ``--data`` other than the default for a model with its own corpus."""
        if self.corpus is not None and data != DEFAULT_DATASET:
            raise ConfigError(f"model {self.name!r} trains on its own corpus, and --data "
                              f"{data} would be ignored", "leave --data out")

    def tokens(self, model: nn.Module, data: str) -> torch.Tensor:
        """The token ids ``model`` trains on: its own corpus, else the data set ``data``."""
        if self.corpus is not None:
            return self.corpus(model)
        from ..data import get_dataset

        return get_dataset(data)


def seq_len_of(model: nn.Module, options: Mapping[str, Any]) -> int:
    """The tokens of a sample's input: the model's ``seq_len``, else its option (default 64)."""
    return int(getattr(model, "seq_len", options.get("seq_len", 64)))


_MODELS: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> None:
    _MODELS[spec.name] = spec


def model_names() -> list[str]:
    return sorted(_MODELS)


def get_model(name: str) -> ModelSpec:
    try:
        return _MODELS[name]
    except KeyError:
        raise unknown("model", name, model_names(), "pass one of them, e.g. --model gpt") from None


register_model(ModelSpec("gpt", GPT, _next_token, cross_entropy,
                         "GPT-style decoder predicting every next byte"))
register_model(ModelSpec("mlp", MLP, _next_byte, cross_entropy,
                         "MLP predicting the byte after a window"))
register_model(ModelSpec("gpt-moe", gpt_moe, _next_token, cross_entropy,
                         "GPT whose feed-forward blocks are mixtures of experts",
                         options=GPTMoEOptions, resolve=resolved_options))
register_model(ModelSpec("wordlm", WordLM, _whole_window, _mean,
                         "word-level LM over the standard library's words: sparse "
                         "embeddings, sampled softmax", options=WordLMOptions, corpus=_words))
