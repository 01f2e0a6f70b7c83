"""Find a model's config: a shipped preset, a config.json, a checkpoint folder, or a hub id.

Presets are real configs of popular gated-MLP models, one JSON file each under ``presets/``:
``{"name", "display_name", "hub_repo", "source", "notes", "config": {...config.json fields...}}``.
Configs are built offline with ``CONFIG_MAPPING[model_type](**fields)``; a hub id goes through
``AutoConfig.from_pretrained`` (which needs the hub or its local cache). A preset's file itself
(``--model path/to/presets/qwen3-8b.json``) is read as that preset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from swiglu_patch.inputs import SourceError, check_source, looks_like_path
from swiglu_patch.memory.shape import REQUIRED_FIELDS, ModelShape

PRESET_PACKAGE = "swiglu_patch.memory"

# Sizes memory depends on: positive integers when a config states them (0 allowed where "none" is meant).
_POSITIVE_FIELDS = REQUIRED_FIELDS + ("num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
                                      "num_local_experts", "n_routed_experts", "num_experts_per_tok",
                                      "experts_per_token")
_NONNEGATIVE_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace")


@dataclass(frozen=True)
class ResolvedModel:
    """A model's config with where it came from.

    Attributes:
        name: preset name, or the path / hub id given.
        display_name: human name for tables.
        source: the config's origin (the hub repo's config.json for presets).
        config: the transformers config (text config for multimodal models).
        checkpoint: a local folder or hub id holding weights, or None (preset, bare config.json).
    """

    name: str
    display_name: str
    source: str
    config: Any
    checkpoint: str | None = None

    def shape(self, family: str | None = None) -> ModelShape:
        return ModelShape.from_config(self.config, name=self.name, source=self.source, family=family)


def _preset_dir():
    return resources.files(PRESET_PACKAGE).joinpath("presets")


def list_presets() -> list[str]:
    """Names of the shipped presets, sorted."""
    return sorted(p.name[: -len(".json")] for p in _preset_dir().iterdir() if p.name.endswith(".json"))


def load_preset_document(name: str) -> dict:
    """The preset's JSON document (see module docstring).

    Raises:
        ValueError: unknown preset; the message lists the presets.
    """
    path = _preset_dir().joinpath(f"{name}.json")
    if not path.is_file():
        raise _unknown(name)
    return json.loads(path.read_text())


def _unknown(spec: str) -> ValueError:
    return ValueError(f"Unknown preset {spec!r}. Presets: {', '.join(list_presets())}. "
                      "Or pass a config.json path, a checkpoint folder or a hub id (owner/name).")


def config_from_dict(fields: dict, *, where: str = "config") -> Any:
    """Build a transformers config offline from config.json fields.

    Multimodal configs (a ``text_config`` inside) give their text config.

    Raises:
        ValueError: no model_type, a model_type transformers does not know, or a required field missing.
    """
    from transformers import CONFIG_MAPPING

    fields = dict(fields)
    if isinstance(fields.get("text_config"), dict) and "hidden_size" not in fields:
        text = dict(fields["text_config"])
        text.setdefault("model_type", f"{fields.get('model_type', '')}_text")
        fields = text
    # a MoE config whose layers are all sparse may leave out the dense intermediate_size (Qwen3.5)
    missing = [f for f in REQUIRED_FIELDS if fields.get(f) is None
               and not (f == "intermediate_size" and fields.get("moe_intermediate_size"))]
    if missing:
        raise ValueError(
            f"{where} lacks {', '.join(missing)}: a gated-MLP decoder config needs {', '.join(REQUIRED_FIELDS)}."
        )
    _check_sizes(fields, where)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ValueError(f"{where} has no model_type; add the model's \"model_type\" (e.g. \"llama\").")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{where}: transformers does not know model_type {model_type!r}; upgrade transformers.")
    fields.pop("transformers_version", None)
    try:
        return CONFIG_MAPPING[model_type](**fields)
    except Exception as exc:  # transformers' (huggingface_hub's) field validation: say which file and why
        raise ValueError(f"{where}: transformers refuses this {model_type} config ({exc}); fix the config.json.") from exc


def _check_sizes(fields: dict, where: str) -> None:
    """ValueError naming the first size that is not an integer, or is negative (zero where it must be positive)."""
    for keys, least in ((_POSITIVE_FIELDS, 1), (_NONNEGATIVE_FIELDS, 0)):
        for key in keys:
            value = fields.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                kind = "a positive integer" if least else "an integer >= 0"
                raise ValueError(f"{where}: {key} must be {kind}, got {value!r}; fix the config.json.")


def resolve_model(spec: str) -> ResolvedModel:
    """Resolve a preset name, a config.json path, a checkpoint folder, or a hub id.

    Raises:
        ValueError: an unknown name that is neither a file, a folder nor reachable on the hub
            (the message lists the presets).
    """
    if spec in list_presets():
        doc = load_preset_document(spec)
        return ResolvedModel(spec, doc.get("display_name", spec), doc["source"],
                             config_from_dict(doc["config"], where=f"preset {spec}"))
    path = Path(spec).expanduser()
    if path.is_file():
        data = read_json(path)
        if _is_preset_document(data):  # a preset's own file: {"name", "source", "config": {...}}
            return ResolvedModel(data.get("name", spec), data.get("display_name", spec), data["source"],
                                 config_from_dict(data["config"], where=f"{path} (its \"config\")"))
        return ResolvedModel(spec, path.parent.name or spec, str(path), config_from_dict(data, where=str(path)))
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{spec} is a folder without config.json; pass the config.json or a checkpoint folder.")
        return ResolvedModel(spec, path.name, str(cfg_path), config_from_dict(read_json(cfg_path), where=str(cfg_path)),
                             str(path))
    if looks_like_path(spec):
        raise ValueError(f"{spec}: no such file or folder ({path.absolute()}); give a config.json, a checkpoint "
                         f"folder, or a preset ({', '.join(list_presets())}).")
    if "/" in spec:
        return _from_hub(spec)
    raise _unknown(spec)


def _is_preset_document(data: dict) -> bool:
    return isinstance(data.get("config"), dict) and "source" in data and "hidden_size" not in data


def read_json(path: Path) -> dict:
    """A JSON object from `path`.

    Raises:
        ValueError: the file cannot be read, is not JSON, or holds no object; the message names the file.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(data).__name__}")
    return data


def _from_hub(repo: str) -> ResolvedModel:
    try:
        check_source(repo, option="--model", what="model config")
    except SourceError as exc:
        raise ValueError(f"{exc} Or use a preset: {', '.join(list_presets())}.") from None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(repo)
    except Exception as exc:  # offline, gated, or missing: say which and what to do instead
        raise ValueError(
            f"Could not read the config of hub id {repo!r} ({type(exc).__name__}: {str(exc)[:200]}). "
            f"Without hub access pass its config.json, or one of the presets: {', '.join(list_presets())}."
        ) from exc
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return ResolvedModel(repo, repo, f"https://huggingface.co/{repo}/blob/main/config.json", config, repo)
