"""What the Hugging Face recipes share: `transformers` imported on demand, pretrained folders read
without running their code, and a pretrained tokenizer as a featurizer.

A `save_pretrained` folder named by `model.params.pretrained` is read with `local_files_only`
(nothing is downloaded), `trust_remote_code` off (a config or tokenizer that names code of its
own is refused by transformers) and weights from safetensors only (never a pickle).

When the folder has a tokenizer, that tokenizer is the featurizer: the model learned its token
ids, so a tokenizer trained afresh would feed it ids that mean other words. It must be a fast
(Rust `tokenizers`) one. Beside every checkpoint it is saved as one JSON document: the
`tokenizers` definition and the names of its special tokens, and it is read back from those
alone, never through a class name the file gives.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch import nn

from trnflow.device.cache import folder_problem
from trnflow.device.layout import TensorPlan
from trnflow.errors import DataError, FatalError, FieldError
from trnflow.lifecycle.exports import copy_export, holds, read_marker
from trnflow.records import manifest_digest
from trnflow.storage import open_store
from trnflow.workload.recipes import families
from trnflow.workload.recipes.lora import LoraParams, adapt, folder_digest

STATE_FORMAT = "trnflow-hf-tokenizer/1"
"""The `format` of a pretrained tokenizer saved as a featurizer."""
DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{% if messages %}{{ '\\n' }}{% endif %}assistant:{% endif %}")
"""The chat template of a tokenizer without one of its own: each turn on a line of its own as
`role: content`, an assistant's turn ending with the end-of-sequence token, and `assistant:` as the
generation prompt; the tokenizer's start token (`<s>`) begins the chat. An export saves it as its
tokenizer's chat template, so that `apply_chat_template` renders chats as training did."""
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "cls_token", "sep_token", "mask_token")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def transformers(recipe: str) -> Any:
    """The `transformers` module, or FatalError saying how to install it."""
    try:
        import transformers as module  # optional (the hf extra), and heavy: ~2 s
    except ModuleNotFoundError:
        raise FieldError("model.recipe", f"{recipe} needs transformers, which is not installed here: "
                         "pip install 'trnflow[hf]'") from None
    module.utils.logging.disable_progress_bar()  # its bar at each load, on every rank, would fill the run's log
    return module


def absolute(folder: str | None) -> str | None:
    """A `pretrained` folder as an absolute path: a relative one is resolved against the directory
    trnflow runs from (as a spec's data locations are), so that every job finds the same folder. An
    s3:// one stays as it is."""
    return str(Path(folder).expanduser().absolute()) if folder and not remote(folder) else folder


def default_positions(seq_len: int) -> int:
    """`max_position_embeddings` of a model built from the params' config (not set there): room for
    `seq_len`, and at least 64."""
    return max(seq_len, 64)


def local_config(folder: str) -> dict[str, Any] | None:
    """A local pretrained folder's config.json, or None when it has none or it cannot be read (which
    loading the model then says: `_weight_files`)."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def remote(folder: str | None) -> bool:
    """Whether a `pretrained` folder is on S3 (fetched by each job into a folder of its own)."""
    return bool(folder) and str(folder).startswith("s3://")


PRETRAINED_CACHE_ENV = "TRNFLOW_PRETRAINED_CACHE"
"""Where s3:// pretrained folders are kept on a machine, one folder per content digest (default:
`$XDG_CACHE_HOME/trnflow/pretrained`, `~/.cache/...` when unset: the user's own)."""


def pretrained_cache() -> Path:
    """The folder s3:// pretrained folders are fetched into: FatalError when it is not this user's
    alone (`folder_problem`: another user could put weights there, or change them after the check)."""
    configured = os.environ.get(PRETRAINED_CACHE_ENV)
    root = Path(configured or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "trnflow" / "pretrained")
    root = root.expanduser().absolute()
    if problem := folder_problem(root):
        raise FatalError(f"model.params.pretrained: its local copy would be kept in {root}, and {problem}: another "
                         f"user could put or change the weights every job here loads; set {PRETRAINED_CACHE_ENV} "
                         "to a folder of your own")
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


def _mine(folder: Path) -> bool:
    """Whether every file and folder in `folder` is this user's, and no one else can write it."""
    me = os.getuid()
    for path in (folder, *folder.rglob("*")):
        info = path.lstat()
        if info.st_uid != me or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or path.is_symlink():
            return False
    return True


def fetched(url: str) -> Path:
    """An s3:// pretrained folder (a trnflow export, or any folder with an `EXPORTED` marker listing
    its files) on this machine: under the user's own cache folder (`pretrained_cache`), named by the
    digest of what its marker lists (the folder's content digest, `folder_digest`), every file checked
    against its checksum. A copy already there is checked again, file by file and for its owner,
    before it is used (another job could have written it); one that does not pass is fetched again."""
    try:
        marker = read_marker(url)
    except DataError as exc:
        raise FatalError(f"model.params.pretrained: {exc}") from None
    digest = manifest_digest(marker.model_dump(mode="json")["files"])
    folder = pretrained_cache() / digest
    if holds(folder, marker) and _mine(folder):
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    try:
        copy_export(url, folder, digest)
    except DataError as exc:
        if holds(folder, marker) and _mine(folder):  # another job on this machine fetched it at the same time
            return folder
        raise FatalError(f"model.params.pretrained: {exc}") from None
    return folder


def pretrained_folder(folder: str) -> Path:
    """The folder `model.params.pretrained` names, once it holds a model `save_pretrained` wrote."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise FatalError(f"model.params.pretrained: {path} has no config.json; give a folder written by "
                         "save_pretrained")
    return path


def _weight_files(folder: Path) -> list[str]:
    """The weight files `from_pretrained` would read from `folder`, once every one is a safetensors
    file inside it; FatalError otherwise. transformers reads a pickle (torch.load) in some layouts
    even when told `use_safetensors`: a config naming other weights (`transformers_weights`), or a
    safetensors index mapping weights to `.bin` shards."""
    def refuse(why: str) -> FatalError:
        return FatalError(f"model.params.pretrained: {folder} {why}; trnflow loads weights from safetensors only "
                          "(save the model with save_pretrained, which writes them)")

    def plain(name: object) -> bool:
        return isinstance(name, str) and name.endswith(".safetensors") and "/" not in name and ".." not in name

    try:
        config = json.loads((folder / "config.json").read_text())
        index = folder / "model.safetensors.index.json"
        mapped = json.loads(index.read_text()).get("weight_map", {}) if index.is_file() else None
    except (OSError, ValueError, AttributeError) as exc:
        raise refuse(f"has a config or weight index that cannot be read ({exc})") from None
    named = config.get("transformers_weights") if isinstance(config, dict) else None
    if named is not None and not plain(named):
        raise refuse(f"names weights {named!r} in config.json (transformers_weights)")
    if mapped is not None:
        files = sorted(set(mapped.values())) if isinstance(mapped, dict) else [mapped]
        if not files or not all(plain(f) and (folder / f).is_file() for f in files):
            raise refuse(f"has a weight index naming {files}, not safetensors files beside it")
        return files
    weights = named or "model.safetensors"
    if not (folder / weights).is_file():
        raise refuse(f"has no {weights}")
    return [weights]


def _read_a_pickle(folder: Path, name: str) -> FatalError:
    return FatalError(f"model.params.pretrained: {folder} holds a file that could be unpickled ({name}); trnflow "
                      "loads weights from safetensors only, and refuses a folder a pickle could be read from: remove "
                      "it, or save the model again with save_pretrained")


PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".npy", ".npz", ".joblib"})
"""Names of files that torch.load, pickle or np.load would unpickle."""
PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04", b"\x93NUMPY")
"""How such files begin, whatever they are named: a pickle (protocols 2 to 5), a zip (torch.save's
format, np.savez's), a NumPy array (which may hold pickled objects)."""


def _pickles(folder: Path) -> list[str]:
    """The files in `folder` (at any depth) that could be unpickled, by name or by their first
    bytes; safetensors files, which only safetensors reads, are the weights and never one."""
    found = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.suffix == ".safetensors":
            continue
        with path.open("rb") as f:
            head = f.read(8)
        if path.suffix.lower() in PICKLE_SUFFIXES or head.startswith(PICKLE_MAGIC):
            found.append(path.relative_to(folder).as_posix())
    return found


def load_pretrained(auto_class: Any, folder: Path) -> Any:
    """`auto_class.from_pretrained` on a local folder: no download, no remote code, safetensors only,
    and the model as its folder defines it: transformers (from 5.25, with the `kernels` package
    installed) would otherwise replace its layers with kernels fetched from a hub, which no device
    of trnflow's runs (the xla device is refused) and which no run may take from outside."""
    _weight_files(folder)
    if found := _pickles(folder):  # nothing in the folder can be unpickled, whatever route a layout takes
        raise _read_a_pickle(folder, found[0])
    try:
        return auto_class.from_pretrained(folder, local_files_only=True, trust_remote_code=False,
                                          use_safetensors=True, use_kernels=False)
    except (OSError, ValueError) as exc:
        raise FatalError(f"model.params.pretrained: {folder} cannot be loaded ({exc})") from None


def has_tokenizer(folder: str | None) -> bool:
    return bool(folder) and any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


OWN_CONFIG_FIELDS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")
"""Config fields a recipe sets itself (from `vocab_size` and the tokenizer it trains), which
`model.params.config` may not: a model whose embeddings disagree with its tokenizer's ids fails,
or on a device that does not check indices reads other memory."""


def config_problem(config: dict[str, Any], seq_len: int) -> str | None:
    """What is wrong with `model.params.config` for a model of `seq_len` tokens, or None."""
    own = [k for k in OWN_CONFIG_FIELDS if k in config]
    if own:
        return (f"config: {', '.join(own)} cannot be set here: the recipe sets them from model.params.vocab_size "
                "and the tokenizer it trains; set model.params.vocab_size instead")
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and positions < seq_len:
        return f"config: max_position_embeddings {positions} is less than seq_len {seq_len}; raise it or cut seq_len"
    return None


class PretrainedTokenizer:
    """A fast `transformers` tokenizer that turns texts into `seq_len` token ids (cut, then padded
    with its pad token)."""

    def __init__(self, tokenizer: Any, seq_len: int, source: str):
        template = getattr(tokenizer, "chat_template", None)
        if template is not None and not isinstance(template, str):
            raise FatalError(f"{source}: the tokenizer has several chat templates; trnflow renders chats with one, the "
                             "tokenizer's chat_template: save the one to use as it")
        if tokenizer.pad_token_id is None:
            raise FatalError(f"{source}: the tokenizer has no pad token; set one (for example "
                             "tokenizer.pad_token = tokenizer.eos_token) and save it again")
        self.tokenizer, self.seq_len = tokenizer, seq_len

    @classmethod
    def from_folder(cls, folder: str, seq_len: int, recipe: str, pad_with_eos: bool = False) -> PretrainedTokenizer:
        """The folder's own tokenizer (`AutoTokenizer.from_pretrained`). `pad_with_eos`: a tokenizer
        without a pad token pads with its end-of-sequence token (as decoders are usually fine-tuned)."""
        auto = transformers(recipe).AutoTokenizer
        try:
            tokenizer = auto.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError) as exc:
            raise FatalError(f"model.params.pretrained: the tokenizer in {folder} cannot be loaded ({exc})") from None
        if not getattr(tokenizer, "is_fast", False):
            raise FatalError(f"model.params.pretrained: the tokenizer in {folder} is not a fast (tokenizers) one; "
                             "save the model's fast tokenizer (a tokenizer.json) there")
        if pad_with_eos and tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        return cls(tokenizer, seq_len, f"model.params.pretrained: {folder}")

    @classmethod
    def from_state(cls, document: dict, seq_len: int, vocab_limit: int, source: str, recipe: str
                   ) -> PretrainedTokenizer:
        """A tokenizer saved by `state`: built from its `tokenizers` definition and the names of its
        special tokens (plain strings), never through a class or code the document names."""
        special = document.get("special")
        definition = document.get("tokenizer")
        if not isinstance(special, dict) or not isinstance(definition, str) or not all(
                k in SPECIAL_TOKENS and isinstance(v, str) for k, v in special.items()):
            raise FatalError(f"{source}: a damaged pretrained tokenizer (it needs 'tokenizer' text and "
                             f"'special' names among {', '.join(SPECIAL_TOKENS)}); use an earlier checkpoint")
        try:
            backend = Tokenizer.from_str(definition)
        except Exception as exc:  # the Rust side raises its own exception type
            raise FatalError(f"{source}: not a tokenizer ({exc}); use an earlier checkpoint") from None
        unknown = [token for token in special.values() if backend.token_to_id(token) is None]
        if unknown:
            raise FatalError(f"{source}: names special tokens {unknown} its vocabulary does not have; it is damaged, "
                             "use an earlier checkpoint")
        template = document.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise FatalError(f"{source}: a damaged pretrained tokenizer (its chat_template is not text); use an "
                             "earlier checkpoint")
        fast = transformers(recipe).PreTrainedTokenizerFast(tokenizer_object=backend, **special)
        fast.chat_template = template  # rendered by transformers in a sandbox: a template runs no code
        if len(fast) > vocab_limit:
            raise FatalError(f"{source}: the tokenizer has {len(fast)} tokens but the model has {vocab_limit} token "
                             "embeddings; it is not this model's tokenizer")
        return cls(fast, seq_len, source)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def own_template(self) -> str | None:
        """The tokenizer's own chat template, or None."""
        return getattr(self.tokenizer, "chat_template", None)

    @property
    def chat_template(self) -> str:
        """The template chats are rendered with: its own, else `DEFAULT_CHAT_TEMPLATE`."""
        return self.own_template or DEFAULT_CHAT_TEMPLATE

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def state(self) -> bytes:
        special = {name: str(getattr(self.tokenizer, name)) for name in SPECIAL_TOKENS
                   if getattr(self.tokenizer, name, None) is not None}
        return json.dumps({"format": STATE_FORMAT, "tokenizer": self.tokenizer.backend_tokenizer.to_str(),
                           "special": special, "chat_template": self.own_template}).encode()

    def encode(self, texts: list[str]) -> torch.Tensor:
        """Token ids, (len(texts), seq_len): cut, then padded with the pad token."""
        return self.tokenizer([t or "" for t in texts], padding="max_length", truncation=True,
                              max_length=self.seq_len, return_tensors="pt")["input_ids"]

    def save(self, folder: Path) -> None:
        """As `save_pretrained` writes it, for `AutoTokenizer.from_pretrained`, with the chat template
        chats were rendered with."""
        own = self.own_template
        self.tokenizer.chat_template = self.chat_template
        try:
            self.tokenizer.save_pretrained(folder)
        finally:
            self.tokenizer.chat_template = own


BYTE_SPECIAL = ("<pad>", "<s>", "</s>")
"""A trained byte-level tokenizer's special tokens: ids 0, 1 and 2."""


def train_byte_tokenizer(texts: Iterable[str], vocab_size: int, recipe: str) -> Any:
    """A byte-level byte-pair encoding of at most `vocab_size` tokens learned from `texts` (the same
    texts always give the same tokens), as a fast `transformers` tokenizer that starts every text
    with `<s>` and pads with `<pad>`: for a model built from a config, which has no tokenizer."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BYTE_SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    pad, bos, eos = BYTE_SPECIAL
    return transformers(recipe).PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, bos_token=bos,
                                                        eos_token=eos)


def chat_turns(messages: object, source: str) -> list[dict[str, str]]:
    """A chat's turns as `{"role", "content"}` records, each role one of `ROLES`; FatalError naming
    `source` (the column and row) otherwise."""
    if not isinstance(messages, list) or not messages:
        raise FatalError(f"{source}: is not a list of turns; each row's chat is a list of {{role, content}} records")
    turns = []
    for n, turn in enumerate(messages):
        role = turn.get("role") if isinstance(turn, dict) else None
        content = turn.get("content") if isinstance(turn, dict) else None
        if role not in ROLES or not isinstance(content, str):
            raise FatalError(f"{source}: turn {n} is not a {{role, content}} record with a role among "
                             f"{', '.join(ROLES)} and text as its content")
        turns.append({"role": role, "content": content})
    return turns


def saved_state(state: bytes) -> dict | None:
    """A featurizer file's document when it is a saved pretrained tokenizer, else None."""
    try:
        document = json.loads(state)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return document if isinstance(document, dict) and document.get("format") == STATE_FORMAT else None


class PretrainedParams(BaseModel):
    """What the settings of a recipe on a `transformers` model share: the model's config or its
    pretrained folder, and the fixed sequence length. Each recipe's own Params gives the defaults."""

    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any] = Field(default_factory=dict, description="Config fields of the model, as for "
                                   "AutoConfig.for_model.")
    pretrained: str | None = Field(
        None,
        description="A local save_pretrained folder to start from (config.json and .safetensors weights); its config "
        "replaces `config`, and its tokenizer, if it has one, is used instead of training one. A relative path is "
        "made absolute when the spec is validated.",
    )
    seq_len: int = Field(64, ge=4, le=32768, description="Fixed sequence length: rows are cut and padded to it.")
    lora: LoraParams | None = Field(
        None, description="Train LoRA adapters (peft) on the pretrained model's frozen weights instead of every "
        "weight: checkpoints then hold the adapters alone, and name the pretrained folder by its digest.")

    @model_validator(mode="after")
    def _config_fits(self) -> PretrainedParams:
        problem = config_problem(self.config, self.seq_len)
        if problem:
            raise ValueError(problem)
        if self.lora is not None and not self.pretrained:
            raise ValueError("lora: adapters train on a pretrained model's frozen weights; set pretrained to its "
                             "save_pretrained folder")
        return self


class FromPretrained:
    """What a recipe on a `transformers` model takes from its pretrained folder: the folder as an
    input a run needs, the folder's own tokenizer, and the model's layers as sharding's blocks."""

    name: ClassVar[str]
    params: PretrainedParams
    pad_with_eos: ClassVar[bool] = False
    """A folder's tokenizer without a pad token pads with its end-of-sequence token (a decoder's)."""
    preloads: ClassVar[tuple[str, ...]] = ("transformers.modeling_utils", "peft")
    """transformers' models and peft: about 4 CPU-s to import in every process that builds one."""

    @classmethod
    def canonical_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """A relative `pretrained` folder made absolute: every job reads the folder the spec meant."""
        folder = params.get("pretrained")
        return {**params, "pretrained": absolute(folder)} if isinstance(folder, str) and folder else params

    def local_inputs(self) -> dict[str, str]:
        folder = self.params.pretrained
        return {"model.params.pretrained": folder} if folder and not remote(folder) else {}

    def remote_inputs(self) -> dict[str, str]:
        folder = self.params.pretrained
        return {"model.params.pretrained": folder} if remote(folder) else {}

    @cached_property
    def _folder(self) -> str | None:
        """The pretrained folder on this machine: the params' own, or an s3:// one fetched."""
        folder = self.params.pretrained
        return str(fetched(folder)) if folder and remote(folder) else folder

    @cached_property
    def _folder_tokenizer(self) -> PretrainedTokenizer | None:
        """The pretrained folder's own tokenizer, if it has one."""
        if not self.params.pretrained:
            return None
        folder = self._folder
        if not has_tokenizer(folder):
            return None
        return PretrainedTokenizer.from_folder(folder, self.params.seq_len, self.name, pad_with_eos=self.pad_with_eos)

    @cached_property
    def _pretrained_config(self) -> dict[str, Any] | None:
        """The pretrained folder's config.json (of an s3:// folder: read alone, checked against its
        marker, without fetching the weights); None without a folder or a config."""
        folder = self.params.pretrained
        if not folder:
            return None
        if not remote(folder):
            return local_config(folder)
        try:
            listed = read_marker(folder).files.get("config.json")
            data = open_store(folder).read("config.json") if listed else b""
        except (DataError, FileNotFoundError) as exc:
            raise FatalError(f"model.params.pretrained: {exc}") from None
        if listed is None or hashlib.sha256(data).hexdigest() != listed.sha256:
            raise FatalError(f"model.params.pretrained: {folder}/config.json is missing from its EXPORTED marker or "
                             "does not match its checksum there; export the model again")
        return json.loads(data)

    def _model_config(self) -> dict[str, Any]:
        """The model's config: the pretrained folder's, else the params' (with their vocab_size)."""
        return self._pretrained_config or {**self.params.config, "vocab_size": getattr(self.params, "vocab_size", 0)}

    @property
    def _embeddings(self) -> int:
        """How many token embeddings the model has."""
        return int(self._model_config()["vocab_size"])

    def _model(self, auto_class: Any, special_ids: dict[str, int]) -> Any:
        """The `transformers` model (`auto_class`): the pretrained folder's, or one built from the
        params' config with the ids of the tokenizer trnflow trains (`special_ids`)."""
        if self.params.pretrained:
            return self._pretrained_model(auto_class)
        p = self.params
        config = transformers(self.name).AutoConfig.for_model(
            p.model_type, **{"vocab_size": p.vocab_size, "max_position_embeddings": default_positions(p.seq_len),
                             **special_ids, **p.config})
        return auto_class.from_config(config)

    def _pretrained_model(self, auto_class: Any) -> Any:
        """The folder's model (`auto_class`), its embeddings checked against the tokenizer it will
        read: the folder's own, or one trained to `vocab_size` tokens."""
        if torch.get_default_device().type == "meta":  # counted, never run: its config builds it, no weights read
            config = dict(self._model_config())
            built = transformers(self.name).AutoConfig.for_model(config.pop("model_type"), **config)
            return auto_class.from_config(built, trust_remote_code=False)
        folder = self._folder
        assert folder, "a pretrained folder"
        model = load_pretrained(auto_class, pretrained_folder(folder))
        own, embeddings = self._folder_tokenizer, model.config.vocab_size
        if own is not None and own.vocab_size > embeddings:
            raise FatalError(f"model.params.pretrained: the tokenizer in {folder} has {own.vocab_size} tokens, the "
                             f"model {embeddings} token embeddings; save the model's own tokenizer there")
        wanted = getattr(self.params, "vocab_size", 0)
        if own is None and embeddings < wanted:
            raise FatalError(f"model.params.vocab_size: {wanted} is more than the pretrained model's {embeddings} "
                             "token embeddings (its folder has no tokenizer, so one is trained); set it to at most "
                             "that, or save the model's own tokenizer there")
        return model

    def _adapt(self, model: Any) -> Any:
        """The `transformers` model with LoRA adapters when the params ask for them, else itself."""
        if self.params.lora is None:
            return model
        return adapt(model, self.params.lora, str(self._model_config().get("model_type", "")))

    @cached_property
    def _base(self) -> str | None:
        folder = self.params.pretrained
        if self.params.lora is None or not folder:
            return None
        if remote(folder):  # fetched, every file checked, into a folder named by its content digest
            return Path(str(self._folder)).name
        return folder_digest(pretrained_folder(folder))

    def base(self) -> str | None:
        """With LoRA: the pretrained folder's content digest (its frozen weights are the base every
        adapter checkpoint needs); else None."""
        return self._base

    def tensor_plan(self, model: nn.Module, tp: int) -> TensorPlan:
        """The family's split of the transformer layers (`families.tensor_plan`), checked against the
        model's own config: Llama-style and GPT-2-style decoders and BERT-style encoders split; others
        are refused."""
        config = next(m.config for m in model.modules() if isinstance(getattr(m, "config", None),
                                                                       transformers(self.name).PretrainedConfig))
        return families.tensor_plan(config, self.blocks(model), tp)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The transformer layers, wherever the architecture keeps them (BERT's `encoder.layer`,
        Llama's `model.layers`, GPT-2's `transformer.h`); none found: the whole model."""
        for module in model.modules():
            for name in ("layer", "layers", "h"):
                layers = getattr(module, name, None)
                if isinstance(layers, nn.ModuleList) and len(layers):
                    return list(layers)
        return []
