"""`hf-causal-lm`: fine-tuning a Hugging Face `transformers` causal language model, built in.

The model is `AutoModelForCausalLM`: from a config given in the params (a tiny Llama-style
decoder by default; no download), or from a local `save_pretrained` folder (safetensors only, no
remote code) with its own tokenizer. Without a pretrained tokenizer, a byte-level byte-pair
encoding is trained on the first run's texts. Either is the featurizer, saved beside every
checkpoint as `tokenizer.json`.

Rows are a `text` column (`data.text_field`), every token of which is trained on; a prompt and a
completion (`prompt_field`, `completion_field`), of which only the completion's tokens (and the
end-of-sequence token after it) count; or a chat (`messages_field`: a list of role/content turns)
rendered with the tokenizer's chat template (`DEFAULT_CHAT_TEMPLATE` for one without), of which
only the assistant's turns count. Each row is one sequence, cut to `seq_len` (a prompt loses its
start before a completion loses anything; a chat loses its end) and padded at the end, so shapes
never change; as the model attends only backwards, the padding is never seen by a real token.
With `data.packing`, training rows follow one another in windows of `seq_len` instead, each
attending only to itself (`trnflow.workload.packing`).

The network's output per row is what every metric needs, computed inside the compiled graph (the
loss in fp32 from the head's logits): the summed next-token loss over the counted tokens, their
number, and how many were predicted right. Training minimises the mean loss per counted token of
the whole step's batch; the evaluation reports it as `loss`, with `perplexity` (its exponential)
and `token_accuracy`; batch inference publishes each row's mean-pooled last hidden state as its
embedding, its log-likelihood and perplexity. At the end of a run the model and its tokenizer are
exported with `save_pretrained`, which `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load (and `generate` from). Needs the `hf` extra
(`pip install 'trnflow[hf]'`).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import BaseModel, Field
from torch import nn

from trnflow.errors import FatalError, FieldError
from trnflow.workload.packing import Packer, counted_targets
from trnflow.workload.recipes.base import Recipe
from trnflow.workload.recipes.hf_causal_lm.decoding import (
    StaticKeyValues,
    attention_mask,
    decode_inputs,
    prefill_inputs,
)
from trnflow.workload.recipes.hf_pretrained import (
    FromPretrained,
    PretrainedParams,
    PretrainedTokenizer,
    chat_turns,
    default_positions,
    local_config,
    remote,
    saved_state,
    train_byte_tokenizer,
    transformers,
)
from trnflow.workload.recipes.lora import save_adapted, unwrapped

GIVEN_POSITIONS = ("llama", "qwen2", "qwen3", "gpt2")
"""The decoders that take each token's position and a 4-D attention mask as given, which packed
training rows (`packed_mask`) and generation with a cache of keys and values (`decoding`) need.
Others derive positions from a 2-D mask (OPT), have none (Bloom's ALiBi) or mask a sliding window
of their own (Mistral), which either would undo."""

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "tie_word_embeddings": True}
"""The default decoder: a tiny Llama-style model that trains in minutes on two cores."""
OUTPUTS = ("nll", "tokens", "correct")
"""What the network gives per row: the summed loss of its counted tokens, how many there are, and
how many of them it predicted right."""


def positions_refused(config: dict[str, Any]) -> str | None:
    """Why a decoder of this config does not take positions and a mask as given, or None."""
    kind = config.get("model_type")
    if kind not in GIVEN_POSITIONS:
        return (f"model_type {kind} does not take positions and an attention mask as given (the "
                f"{', '.join(GIVEN_POSITIONS[:-1])} and {GIVEN_POSITIONS[-1]} decoders do)")
    if config.get("use_sliding_window"):
        return "the decoder masks a sliding window of its own"
    return None


def _config(params: HfCausalLmParams) -> dict[str, Any]:
    """The decoder's config as far as the params tell before it is built: a local pretrained
    folder's config.json (an s3:// one's is read as the model is built), or the params' own."""
    folder = params.pretrained
    config = local_config(folder) if folder and not remote(folder) else None
    return config or {"model_type": params.model_type, **params.config}


class HfCausalLmParams(PretrainedParams):
    """The decoder's config (or its pretrained folder), the tokenizer and the rows' layout."""

    model_type: str = Field("llama", description="The transformers model type the config is for (llama, qwen2, "
                            "mistral, ...).")
    config: dict[str, Any] = Field(default_factory=lambda: dict(SMALL),
                                   description="Config fields of the decoder, as for AutoConfig.for_model.")
    vocab_size: int = Field(2048, ge=256, le=1_000_000, description="Token vocabulary size of the tokenizer trnflow "
                            "trains (a pretrained folder's tokenizer keeps its own).")
    rows: Literal["text", "prompt-completion", "chat"] = Field(
        "prompt-completion", description="text: the data's text_field is trained on whole; prompt-completion: only "
        "the completion's tokens count in the loss and the metrics; chat: messages rendered with the tokenizer's chat "
        "template, only the assistant's turns counting.")
    prompt_field: str = Field("prompt", description="The prompt's column (rows: prompt-completion).")
    completion_field: str = Field("completion", description="The completion's column (rows: prompt-completion).")
    messages_field: str = Field("messages", description="The chat's column (rows: chat): a list of turns, each a "
                                "role (system, user or assistant) and its content.")


def packed_mask(positions: torch.Tensor, attention: str, dtype: torch.dtype) -> torch.Tensor:
    """The attention mask of packed windows (windows, 1, seq_len, seq_len): each token sees the
    tokens of its own row (a run of positions from 0) up to itself. Made from the positions alone,
    with the same operations whatever they hold, so a window of one row and one of many are one
    graph; as `attention` takes it: True where it may look (sdpa), or added to the scores (eager)."""
    row = (positions == 0).cumsum(-1)
    at = torch.arange(positions.shape[-1], device=positions.device)
    allowed = ((row.unsqueeze(-1) == row.unsqueeze(-2)) & (at.unsqueeze(-1) >= at.unsqueeze(-2))).unsqueeze(1)
    return attention_mask(allowed, attention, dtype)


def _given_refused(lm: nn.Module) -> str | None:
    """Why the transformers model inside `lm` does not take positions and a 4-D mask as given (by
    its config, and by its attention), which packed rows and the cache of keys and values need; or None."""
    config = unwrapped(lm).config
    refused = positions_refused({**config.to_dict(), "model_type": config.model_type})
    if refused is None and config._attn_implementation not in ("sdpa", "eager"):
        refused = f"its attention ({config._attn_implementation}) does not take a mask as given (sdpa and eager do)"
    return refused


class _RightPadding(logging.Filter):
    """Drops transformers' "We strongly recommend passing in an `attention_mask`" (a decoder given
    no mask whose ids hold its pad token, GPT-2's on every run): a causal LM's rows here are padded
    on the right only, so no real token attends to a pad, and the message, which the user can do
    nothing about, would only alarm them. Packed windows and generation through the cache pass
    their masks."""

    MESSAGE = "We strongly recommend passing in an `attention_mask`"

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.MESSAGE)


def _quiet_right_padding() -> None:
    logger = logging.getLogger("transformers.modeling_utils")
    if not any(isinstance(f, _RightPadding) for f in logger.filters):
        logger.addFilter(_RightPadding())


class CausalLanguageModel(nn.Module):
    """A causal LM whose output per row is its summed token loss, token count and right guesses.
    `lm` is the transformers model, or a peft model of LoRA adapters around it."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        _quiet_right_padding()
        forward = unwrapped(lm).base_model.forward  # transformers 5 renames `past_key_values` to `cache`
        self.cache_keyword = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
        self.cache_refused = _given_refused(lm)
        """Why it cannot generate with a cache (`prefill`, `decode_next`), or None: programs that
        would are refused before they are traced."""

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden states; with `positions` (packed windows), each row attends only to itself."""
        lm = unwrapped(self.lm)
        mask = None if positions is None else packed_mask(positions, lm.config._attn_implementation,
                                                          lm.get_input_embeddings().weight.dtype)
        return lm.base_model(input_ids=ids, position_ids=positions, attention_mask=mask,
                             use_cache=False).last_hidden_state

    def _scores(self, ids: torch.Tensor, counted: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        logits = unwrapped(self.lm).get_output_embeddings()(hidden)[:, :-1].float()
        target, weight = ids[:, 1:], counted[:, 1:].float()  # position t predicts token t + 1
        nll = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        right = (logits.argmax(-1) == target).float()
        return torch.stack([(nll * weight).sum(1), weight.sum(1), (right * weight).sum(1)], 1)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """(rows, 3, seq_len) ids, real-token mask and counted-token mask -> (rows, 3) scores; packed
        windows (data.packing) add their tokens' positions, (windows, 4, seq_len) -> (windows, 3)."""
        ids = rows[:, 0]
        positions = rows[:, 3] if rows.shape[1] > 3 else None
        return self._scores(ids, counted_targets(rows[:, 2], positions), self._hidden(ids, positions))

    def next_logits(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(rows, length) token ids and each row's length -> (rows, vocabulary) fp32 logits of the
        token after its last: padding after a row's length is never seen (the model attends only
        backwards), so one buffer shape serves every step of a generation."""
        hidden = self._hidden(ids)
        at = (lengths - 1).view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
        return unwrapped(self.lm).get_output_embeddings()(hidden.gather(1, at).squeeze(1)).float()

    def prefill(self, ids: torch.Tensor, starts: torch.Tensor, room: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts (rows, seq_len), each ending at the last slot and starting at its `starts`
        (`generate.end_aligned`) -> the logits of each row's next token (rows, vocabulary; fp32) and
        the cache of keys and values, with `room` slots for the tokens to come (`decoding`)."""
        lm = unwrapped(self.lm)
        positions, allowed = prefill_inputs(starts, ids.shape[1])
        cache = StaticKeyValues()
        hidden = self._cached(lm, ids, positions, allowed, cache)
        return lm.get_output_embeddings()(hidden[:, -1]).float(), cache.stacked(room)

    def decode_next(self, tokens: torch.Tensor, slot: torch.Tensor, starts: torch.Tensor,
                    cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token per row (rows,), all at the cache's `slot` (a 0-d tensor) -> the logits of
        the token after it and the cache with its keys and values in that slot."""
        lm = unwrapped(self.lm)
        positions, allowed = decode_inputs(starts, slot, cache.shape[-2])
        written = StaticKeyValues(cache, slot)
        hidden = self._cached(lm, tokens.view(-1, 1), positions, allowed, written)
        return lm.get_output_embeddings()(hidden[:, -1]).float(), written.stacked()

    def _cached(self, lm: nn.Module, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                cache: StaticKeyValues) -> torch.Tensor:
        mask = attention_mask(allowed, lm.config._attn_implementation, lm.get_input_embeddings().weight.dtype)
        return lm.base_model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                             **{self.cache_keyword: cache}).last_hidden_state

    def embed(self, rows: torch.Tensor) -> torch.Tensor:
        """Each row's last hidden state mean-pooled over its real tokens, then its summed token loss
        and its token count: (rows, hidden_size + 2)."""
        ids, real = rows[:, 0], rows[:, 1].unsqueeze(-1)
        hidden = self._hidden(ids)
        weights = real.to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return torch.cat([pooled.float(), self._scores(ids, rows[:, 2], hidden)[:, :2]], 1)


class HfCausalLm(FromPretrained, Recipe):
    """A transformers causal LM (from a config or a save_pretrained folder) fine-tuned on text or
    prompt/completion rows."""

    name = "hf-causal-lm"
    version = "1"
    Params = HfCausalLmParams
    params: HfCausalLmParams
    featurizer_file = "tokenizer.json"
    metrics = ("loss", "perplexity", "token_accuracy")
    pad_with_eos = True
    generates = True
    packs = True
    tokenizer: PretrainedTokenizer | None = None

    # -- rows to tensors -------------------------------------------------------------------------

    @property
    def num_classes(self) -> None:
        return None

    @property
    def width(self) -> int:
        return len(OUTPUTS)

    def columns(self) -> list[str]:
        p = self.params
        return {"text": [self.data.text_field], "chat": [p.messages_field]}.get(
            p.rows, [p.prompt_field, p.completion_field])

    def _texts(self, rows: pa.Table) -> Iterator[str]:
        if self.params.rows == "chat":
            for messages in rows.column(self.params.messages_field).to_pylist():
                yield from (turn.get("content") or "" for turn in messages or [] if isinstance(turn, dict))
            return
        for name in self.columns():
            yield from (str(v) for v in rows.column(name).to_pylist())

    def fit(self, rows: pa.Table) -> None:
        self.fit_batches([rows])

    def fit_batches(self, batches: Iterable[pa.Table]) -> None:
        if self._folder_tokenizer is not None:
            self.tokenizer = self._folder_tokenizer
            return
        texts = (text for rows in batches for text in self._texts(rows))
        self.tokenizer = PretrainedTokenizer(train_byte_tokenizer(texts, self.params.vocab_size, self.name),
                                             self.params.seq_len, "the trained tokenizer")

    def state(self) -> bytes:
        assert self.tokenizer is not None, "fit or load the tokenizer first"
        return self.tokenizer.state()

    def load(self, state: bytes, source: str) -> None:
        document = saved_state(state)
        if document is None:
            raise FatalError(f"{source}: its {self.featurizer_file} is not a tokenizer hf-causal-lm saved; use a "
                             "checkpoint of this recipe")
        self.tokenizer = PretrainedTokenizer.from_state(document, self.params.seq_len, self._embeddings, source,
                                                        self.name)

    def _parts(self, rows: pa.Table) -> list[tuple[list[int] | None, Any]]:
        """Each row's tokens, whole: (prompt ids, counted ids) of a text (no prompt) or a prompt and
        its completion (with the end-of-sequence token), or (None, (ids, counted mask)) of a chat."""
        assert self.tokenizer is not None, "fit or load the tokenizer first"
        tok = self.tokenizer.tokenizer
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        if self.params.rows == "text":
            texts = [str(t or "") for t in rows.column(self.data.text_field).to_pylist()]
            parts = [([], ids + eos) for ids in tok(texts, add_special_tokens=True)["input_ids"]]
        elif self.params.rows == "chat":
            parts = [(None, self.chat(messages, n)) for n, messages in
                     enumerate(rows.column(self.params.messages_field).to_pylist())]
        else:
            p = self.params
            prompts = tok([str(t or "") for t in rows.column(p.prompt_field).to_pylist()],
                          add_special_tokens=True)["input_ids"]
            completions = tok([str(t or "") for t in rows.column(p.completion_field).to_pylist()],
                              add_special_tokens=False)["input_ids"]
            parts = list(zip(prompts, [c + eos for c in completions], strict=True))
        return parts

    def features(self, rows: pa.Table) -> torch.Tensor:
        """(rows, 3, seq_len): token ids, 1 where a token is real, 1 where a token counts."""
        parts = self._parts(rows)
        assert self.tokenizer is not None
        seq, special = self.params.seq_len, set(self.tokenizer.tokenizer.all_special_ids)
        out = torch.zeros(len(parts), 3, seq, dtype=torch.long)
        out[:, 0] = self.tokenizer.pad_id
        for i, (prompt, counted) in enumerate(parts):
            if prompt is None:  # a chat: its ids and which of them count, cut at the end
                ids, mask = counted[0][:seq], counted[1][:seq]
                out[i, 0, :len(ids)] = torch.tensor(ids, dtype=torch.long)
                out[i, 1, :len(ids)] = 1
                out[i, 2, :len(ids)] = torch.tensor(mask, dtype=torch.long)
                continue
            counted = counted[:seq]
            lead = next((n for n, t in enumerate(prompt) if t not in special), len(prompt))  # <s> and the like
            room = max(0, seq - len(counted) - lead)
            prompt = prompt[:min(lead, seq - len(counted))] + prompt[lead:][max(0, len(prompt) - lead - room):]
            ids = prompt + counted
            out[i, 0, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            out[i, 1, :len(ids)] = 1
            out[i, 2, len(prompt):len(ids)] = 1
        return out

    @classmethod
    def packing_problem(cls, params: BaseModel) -> str | None:
        """A decoder that does not take the packed rows' positions and mask (`positions_refused`)."""
        assert isinstance(params, HfCausalLmParams)
        refused = positions_refused(_config(params))
        return None if refused is None else f"{refused}, which packed rows need; remove data.packing"

    @classmethod
    def kv_cache_problem(cls, params: BaseModel) -> str | None:
        """A decoder that does not take the cached rows' positions and mask (`positions_refused`)."""
        assert isinstance(params, HfCausalLmParams)
        refused = positions_refused(_config(params))
        return None if refused is None else (f"{refused}, which generating with a cache needs; set "
                                             "inference.generate.kv_cache: false")

    def packer(self) -> Packer:
        assert self.tokenizer is not None, "fit or load the tokenizer first"
        return Packer(self.params.seq_len, self.tokenizer.pad_id)

    def token_lengths(self, rows: pa.Table) -> list[int] | None:
        """Each row's tokens (a chat's whole rendering; a prompt and its completion; a text), counted
        with the pretrained folder's tokenizer; None without one (it is fitted on the data first)."""
        if self.tokenizer is None:
            if self._folder_tokenizer is None:
                return None
            self.tokenizer = self._folder_tokenizer
        return [len(counted[0]) if prompt is None else len(prompt) + len(counted)
                for prompt, counted in self._parts(rows)]

    @property
    def input_length(self) -> int:
        return self.params.seq_len

    def chat(self, messages: object, row: int) -> tuple[list[int], list[int]]:
        """A chat's token ids, rendered with the tokenizer's chat template, and 1 for each token of an
        assistant's turn (the tokens from the end of its generation prompt to the end of the turn)."""
        assert self.tokenizer is not None, "fit or load the tokenizer first"
        turns = chat_turns(messages, f"{self.params.messages_field} of row {row}")
        template = self.tokenizer.chat_template
        tok = self.tokenizer.tokenizer

        def ids(part: list[dict], prompt: bool = False) -> list[int]:
            text = tok.apply_chat_template(part, chat_template=template, tokenize=False, add_generation_prompt=prompt)
            return tok(text, add_special_tokens=False)["input_ids"]  # the template writes the start token

        whole = ids(turns)
        counted = [0] * len(whole)
        for n, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            start, through = len(ids(turns[:n], prompt=True)), ids(turns[:n + 1])
            if whole[:len(through)] != through or start > len(through):
                raise FatalError(f"{self.params.messages_field} of row {row}: the chat template does not render the "
                                 "start of a chat as the start of the whole chat, so the assistant's tokens cannot be "
                                 "found; use a template that renders each turn after the ones before it")
            counted[start:len(through)] = [1] * (len(through) - start)
        return whole, counted

    def example(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        vocab = self._folder_tokenizer.vocab_size if self._folder_tokenizer else self.params.vocab_size
        ids = torch.randint(0, vocab, (rows, self.params.seq_len), generator=generator)
        return torch.stack([ids, torch.ones_like(ids), torch.ones_like(ids)], 1)

    # -- the network -----------------------------------------------------------------------------

    def build_model(self) -> CausalLanguageModel:
        ids = {f"{name}_token_id": i for i, name in enumerate(("pad", "bos", "eos"))}  # as BYTE_SPECIAL
        lm = self._model(transformers(self.name).AutoModelForCausalLM, ids)
        if self.data.packing and (refused := _given_refused(lm)):
            raise FatalError(f"data.packing: {refused}, which packed rows need; remove data.packing")
        return CausalLanguageModel(self._adapt(lm))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss over the counted tokens of the whole step's batch, on every rank
        alike: ranks count different numbers of tokens, and their gradients are averaged, so each
        rank's summed loss is divided by the tokens of all ranks (and multiplied by their number) for
        its gradient, while its value is the batch's mean (what training logs and checks)."""
        nll, tokens = logits[:, 0].sum(), logits[:, 1].sum()
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return nll / tokens.clamp_min(1.0)
        both = torch.stack([nll.detach(), tokens.detach()])
        dist.all_reduce(both)
        total = both[1].clamp_min(1.0)
        scaled = nll * dist.get_world_size() / total  # its gradient, averaged over the ranks, is the batch's
        return scaled + (both[0] / total - scaled).detach()  # its value: the batch's mean, as every rank logs it

    def activation_bytes(self, batch: int, value_bytes: int, tp: int = 1) -> int:
        """Per layer: the attention's projections and scores and the MLP's three projections (of which
        each of `tp` cores keeps its part, but of the two norms' inputs); then the head's logits over the
        vocabulary, their fp32 copy and the loss's log-softmax, whole on every core."""
        return self.recomputed_bytes(batch, value_bytes, "none", tp)

    def recomputed_bytes(self, batch: int, value_bytes: int, setting: str, tp: int = 1) -> int:
        """Of each layer, selective keeps the projections' outputs and the attention's scores (not the
        norms' inputs nor the softmax), full the layer's input and one layer's whole while it is
        recomputed; the head's logits are kept either way."""
        config = self._model_config()
        seq, hidden = self.params.seq_len, int(config.get("hidden_size", 64))
        inner, layers = int(config.get("intermediate_size", 4 * hidden)), int(config.get("num_hidden_layers", 2))
        heads, vocab = int(config.get("num_attention_heads", 4)), int(config.get("vocab_size", self.params.vocab_size))
        per_layer = batch * seq * (2 * hidden + (4 * hidden + 3 * inner) // tp) + 2 * batch * heads * seq * seq // tp
        products = batch * seq * ((4 * hidden + 3 * inner) // tp) + batch * heads * seq * seq // tp
        kept = {"none": layers * per_layer, "selective": layers * products,
                "full": layers * batch * seq * hidden + per_layer}[setting]
        head = batch * seq * vocab * (value_bytes + 8)
        return (kept + 2 * batch * seq * hidden) * value_bytes + head

    # -- generation ------------------------------------------------------------------------------

    def prompts(self, features: torch.Tensor, room: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's prompt: the tokens before its completion (prompt-completion), before its last
        assistant turn (chat; the template's generation prompt included), or its text without its
        end (text: the text goes on). Ids (rows, seq_len + room), then each prompt's length."""
        # Before the featurizer is fitted (the compile stage's trial): the ids its tokenizer will have
        tokenizer = self.tokenizer or self._folder_tokenizer
        pad, eos = (tokenizer.pad_id, tokenizer.tokenizer.eos_token_id) if tokenizer else (0, 2)  # BYTE_SPECIAL's
        positions = self._position_table()
        if isinstance(positions, int) and self.params.seq_len + room > positions:
            raise FatalError(f"inference.generate.max_new_tokens: {room} tokens after a row of seq_len "
                             f"{self.params.seq_len} exceed the model's {positions} positions; generate fewer")
        ids, real, counted = features[:, 0], features[:, 1], features[:, 2]
        lengths = real.sum(1)
        for i in range(len(features)):
            marks = counted[i].nonzero().flatten().tolist()
            if not marks:
                continue
            start = marks[-1]
            while start > 0 and counted[i, start - 1]:
                start -= 1
            if start > 0:
                lengths[i] = start
            elif int(ids[i, lengths[i] - 1]) == eos and lengths[i] > 1:
                lengths[i] -= 1
        buffer = torch.full((len(features), self.params.seq_len + room), pad, dtype=torch.long)
        buffer[:, :ids.shape[1]] = ids.masked_fill(torch.arange(ids.shape[1]) >= lengths.unsqueeze(1), pad)
        return buffer, lengths

    def _position_table(self) -> int | None:
        """How many positions a GPT-2 style decoder embeds (absolute positions); None for others.
        One built from the params has `default_positions` unless its config says otherwise."""
        config = self._model_config()
        if isinstance(config.get("n_positions"), int):
            return config["n_positions"]
        if not self.params.pretrained and self.params.model_type == "gpt2":
            return int(config.get("max_position_embeddings", default_positions(self.params.seq_len)))
        return None

    def decode(self, tokens: list[list[int]]) -> list[str]:
        assert self.tokenizer is not None, "fit or load the tokenizer first"
        return self.tokenizer.tokenizer.batch_decode(tokens, skip_special_tokens=True)

    @property
    def end_token(self) -> int | None:
        assert self.tokenizer is not None, "fit or load the tokenizer first"
        return self.tokenizer.tokenizer.eos_token_id

    # -- what its outputs mean -------------------------------------------------------------------

    def evaluate(self, outputs: torch.Tensor, labels: torch.Tensor, names: list[str]) -> dict[str, float | None]:
        """Over every counted token of the holdout set: the mean loss, perplexity and token accuracy."""
        nll, tokens, right = (outputs[:, i].sum().item() for i in range(len(OUTPUTS)))
        if not tokens:
            raise FieldError("model.params.seq_len", self._nothing_counts(len(outputs)))
        loss = nll / tokens
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "token_accuracy": right / tokens}

    def _nothing_counts(self, rows: int) -> str:
        """Why no token of `rows` holdout rows counted, and what to do."""
        counted = {"text": "text", "prompt-completion": "completion", "chat": "assistant's turns"}[self.params.rows]
        return (f"no token of the {rows} holdout rows counts: each was cut to {self.params.seq_len} tokens before its "
                f"{counted} (training had nothing to learn either); raise model.params.seq_len to fit them "
                "(`trnflow data check SPEC` counts the rows cut)")

    def outcomes(self, outputs: torch.Tensor, labels: torch.Tensor) -> None:
        return None  # a row's text is not right or wrong

    def publish(self, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each row's embedding, the log-likelihood of its counted tokens, their perplexity (NaN for
        a row with none) and their number."""
        nll, tokens = outputs[:, -2], outputs[:, -1]
        return {"embedding": outputs[:, :-2].contiguous(), "log_likelihood": (-nll).contiguous(),
                "perplexity": torch.exp(nll / tokens).where(tokens > 0, torch.tensor(float("nan"))),
                "tokens": tokens.round().long()}

    def export(self, model: nn.Module, folder: Path) -> bool:
        """The trained model and its tokenizer as `save_pretrained` writes them; with LoRA, the
        adapter alone in PEFT's format under `adapter/` and the model merged with it in the folder."""
        assert isinstance(model, CausalLanguageModel) and self.tokenizer is not None
        if self.params.lora is not None:
            save_adapted(model.lm, folder)
        else:
            model.lm.save_pretrained(folder)
        self.tokenizer.save(folder)
        (folder / "trnflow.json").write_text(self.describe().model_dump_json(indent=2))
        return True
