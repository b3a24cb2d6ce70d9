"""docs/configuration.md documents every setting, and names no ``KB_`` variable that is none.

The settings models are found, not listed: every subclass of pydantic-settings'
``BaseSettings`` defined in a module of the ``services`` package or of the tools'
(``kbtools``), so a new model is held to the page the day it is written. Each field's
environment variables are computed as pydantic-settings reads them: its alias names when it
has an alias, else ``env_prefix`` + the field name, matched case-insensitively (written
upper-case). A model that reads the environment through a source of its own must have that
source's names taught to this test (``CUSTOM_SOURCES``): otherwise the test fails rather
than guess.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import typing
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from pydantic import AliasChoices, AliasPath, BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

import kbtools
import services
from services.embedding.profiles import PROFILE_PREFIX
from services.embedding.settings import ENV_PREFIX, EmbeddingSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# Upper-case words as written in the page: variable names, and prefixes such as
# `KB_EMBEDDING_` (written before `<FIELD>` or `*`), which end in an underscore.
_WORD = re.compile(r"(?<![A-Za-z0-9_])[A-Z][A-Z0-9_]*(?![a-z0-9])")

# `KB_` words the page may name although no settings model reads them. Kept empty on
# purpose: every `KB_` word there today is a setting; add one here only with the reason.
NOT_SETTINGS: frozenset[str] = frozenset()

Model = type[BaseSettings]


def settings_models() -> dict[str, Model]:
    """Every ``BaseSettings`` subclass defined in ``services`` or ``kbtools``, by its dotted
    path."""
    found: dict[str, Model] = {}
    packages = pkgutil.walk_packages(services.__path__, "services.")
    tools = pkgutil.walk_packages(kbtools.__path__, "kbtools.")
    for info in [*packages, *tools]:
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseSettings)
                and value is not BaseSettings
                and value.__module__ == module.__name__
            ):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


def _alias_names(alias: str | AliasPath | AliasChoices) -> set[str]:
    """The variables an alias stands for (an ``AliasPath`` reads its first element)."""
    if isinstance(alias, str):
        return {alias}
    if isinstance(alias, AliasPath):
        return {str(alias.path[0])}
    names: set[str] = set()
    for choice in alias.choices:
        names |= _alias_names(choice)
    return names


def field_variables(model: Model, name: str, field: FieldInfo) -> set[str]:
    """The variables pydantic-settings' environment source reads for one field."""
    alias = field.validation_alias if field.validation_alias is not None else field.alias
    if alias is not None:
        names = _alias_names(alias)
    else:
        names = {f"{model.model_config.get('env_prefix', '')}{name}"}
    return {n.upper() for n in names}


def _flat_union_variables(model: Model, name: str, field: FieldInfo) -> set[str]:
    """``services.embedding.settings._FlatProviderSource``: a discriminated union of models
    built from flat variables. ``<prefix><FIELD>`` names the member (its discriminator
    value), ``<prefix><MEMBER FIELD>`` fills the member's other fields. Its alias is a
    placeholder nobody sets."""
    discriminator = field.discriminator
    members = [
        member
        for member in typing.get_args(field.annotation)
        if inspect.isclass(member) and issubclass(member, BaseModel)
    ]
    assert isinstance(discriminator, str), f"{model.__name__}.{name}: no discriminator field"
    assert members, f"{model.__name__}.{name}: not a union of models"
    prefix = str(model.model_config.get("env_prefix", ""))
    variables = {f"{prefix}{name}".upper()}
    for member in members:
        variables |= {
            f"{prefix}{member_field}".upper()
            for member_field in member.model_fields
            if member_field != discriminator
        }
    return variables


# Models with a settings source of their own: which of their fields it builds, and how that
# source names their variables. The other fields are read by the usual environment source.
FieldVariables = Callable[[Model, str, FieldInfo], set[str]]
CUSTOM_SOURCES: dict[Model, dict[str, FieldVariables]] = {
    EmbeddingSettings: {"provider": _flat_union_variables},
}


def model_variables(model: Model) -> set[str]:
    """Every environment variable ``model`` reads."""
    assert not model.model_config.get("case_sensitive", False), (
        f"{model.__name__} is case-sensitive: compare its names exactly"
    )
    custom = CUSTOM_SOURCES.get(model)
    if custom is None:
        assert "settings_customise_sources" not in vars(model), (
            f"{model.__name__} reads the environment through a source of its own: teach "
            "CUSTOM_SOURCES in this test which variables it reads"
        )
        custom = {}
    variables: set[str] = set()
    for name, field in model.model_fields.items():
        variables |= custom.get(name, field_variables)(model, name, field)
    return variables


def documented_words(text: str) -> set[str]:
    return set(_WORD.findall(text))


def undocumented(variables: Iterable[str], text: str) -> list[str]:
    """The variables the page does not name (as a whole word)."""
    words = documented_words(text)
    return sorted(v for v in variables if v not in words)


def is_profile_variable(word: str) -> bool:
    """``KB_EMBEDDING_PROFILE_<NAME>_<FIELD>`` (services/embedding/profiles.py): any profile
    name, then what follows ``KB_EMBEDDING_`` in a variable of ``EmbeddingSettings``; or the
    prefix itself, as the page writes it before ``<NAME>``."""
    if not word.startswith(PROFILE_PREFIX):
        return False
    parts = word.removeprefix(PROFILE_PREFIX).split("_")
    if parts == [""]:
        return True
    embedding = model_variables(EmbeddingSettings)
    return any(ENV_PREFIX + "_".join(parts[i:]) in embedding for i in range(1, len(parts)))


def unknown_kb_words(text: str, variables: set[str]) -> list[str]:
    """``KB_`` words of the page that name no setting: a word ending in ``_`` is a prefix
    and must begin at least one setting's variable."""
    unknown = []
    for word in documented_words(text):
        if not word.startswith("KB_") or word in NOT_SETTINGS or is_profile_variable(word):
            continue
        if word.endswith("_"):
            known = any(v.startswith(word) for v in variables)
        else:
            known = word in variables
        if not known:
            unknown.append(word)
    return sorted(unknown)


@pytest.fixture(scope="module")
def models() -> dict[str, Model]:
    return settings_models()


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def test_the_models_are_found(models: dict[str, Model]) -> None:
    # The discovery itself can fail quietly (nothing found, nothing checked): these exist.
    for expected in (
        "services.runtime.settings.RuntimeSettings",
        "services.indexer.settings.IndexerSettings",
        "services.embedding.settings.EmbeddingSettings",
    ):
        assert expected in models


def test_every_model_has_its_table(models: dict[str, Model], doc: str) -> None:
    headings = {line.removeprefix("## ").strip() for line in doc.splitlines()}
    assert sorted(path for path in models if path not in headings) == []


def test_every_setting_is_documented(models: dict[str, Model], doc: str) -> None:
    missing = {path: undocumented(model_variables(model), doc) for path, model in models.items()}
    assert {path: names for path, names in missing.items() if names} == {}


def test_every_kb_variable_documented_is_a_setting(models: dict[str, Model], doc: str) -> None:
    variables = set().union(*(model_variables(model) for model in models.values()))
    assert unknown_kb_words(doc, variables) == []


def test_the_flat_provider_variables_are_the_ones_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The names computed for the provider are the ones its source reads."""
    variables = model_variables(EmbeddingSettings)
    assert {"KB_EMBEDDING_PROVIDER", "KB_EMBEDDING_DIMENSIONS"} <= variables
    assert "KB_EMBEDDING_PROVIDER_CONFIG_UNUSED" not in variables
    monkeypatch.setenv("KB_EMBEDDING_PROVIDER", "hashing")
    monkeypatch.setenv("KB_EMBEDDING_DIMENSIONS", "7")
    provider = EmbeddingSettings().provider
    assert (provider.kind, getattr(provider, "dimensions", None)) == ("hashing", 7)


def test_the_checks_catch_a_planted_mistake() -> None:
    variables = {"KB_INDEXER", "KB_INDEXER_LEASE_SECONDS", "DATABASE_URL"}
    text = "`KB_INDEXER_LEASE_SECONDS`, `DATABASE_URL`, `KB_INDEXER_*`, `KB_NOT_A_SETTING`"
    # KB_INDEXER is only a prefix of a documented word: still undocumented.
    assert undocumented(variables, text) == ["KB_INDEXER"]
    assert unknown_kb_words(text, variables) == ["KB_NOT_A_SETTING"]
    assert unknown_kb_words("`KB_RELAY_*`", variables) == ["KB_RELAY_"]
    profiles = (
        "`KB_EMBEDDING_PROFILE_<NAME>_<FIELD>`, `KB_EMBEDDING_PROFILE_HOSTED_API_KEY`, "
        "`KB_EMBEDDING_PROFILE_MY_HOST_MODEL`, `KB_EMBEDDING_PROFILE_HOSTED_NOT_A_FIELD`, "
        "`KB_EMBEDDING_PROFILE_MODEL`"
    )
    assert unknown_kb_words(profiles, variables) == [
        "KB_EMBEDDING_PROFILE_HOSTED_NOT_A_FIELD",
        "KB_EMBEDDING_PROFILE_MODEL",
    ]
