"""Search generations on the indexer's side, in one room (docs/architecture.md#index-generations).

- ``model.py``: what `kb index generations` asks and answers (specs, outcomes, progress);
- ``queries.py`` with ``generations.sql``: the statements of create, list, status, switch
  and retire, and the lookups they share;
- ``store_pg.py``: create, list and status in PostgreSQL; ``switch.py`` and ``retire.py``:
  the switch of a tenant's serving generation and a generation's retirement;
- ``build.py``: a generation's pipeline, built when its first task arrives;
- ``cli.py``: `kb index generations create|list|status|switch|retire`.

What stays below the room, because the rooms below it run it: the registration of the
default generation and what a fenced completion records of the generation it builds
(``sink/generations.py`` with ``sink/generations.sql``: the one upsert of a generation
record, ``upsert_document_generation_version``, is there), and the pipeline kept per
generation (``pipeline/generations.py``). A generation's identity, shared with search, is
``services/index/generation.py`` and ``generations.py``.
"""
