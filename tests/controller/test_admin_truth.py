"""Admin answers that tell the truth: ``move`` and ``evict`` count moved, kept-as-pinned and
missing chunks apart; pins are counted and ``pins`` lists them; an instance is found under the
name it is served as as well as its namespace's model name."""

from __future__ import annotations

import base64
import json

import pytest

from kvlayer.cli import main
from kvlayer.controller.client import AdminClient, ControllerError
from tests.controller.harness import CHUNK, MODEL, ServerThread, connect, make_kv, store_tokens, wait_until

SERVED = "models/tiny"
"""The name instance "a" is served under (``served_model_name``), unlike its namespace's ``MODEL``."""
TOKENS = list(range(1, 17))
"""Four chunks."""
OTHER = list(range(100, 112))
"""Three chunks held nowhere."""


@pytest.fixture
def fleet(tmp_path, tiny_model_dir):
    """A controller that tokenizes text of ``MODEL`` with the tiny model's tokenizer, and instance
    "a" (CPU and NVMe tiers, served as ``SERVED``) holding ``TOKENS`` on its CPU tier only."""
    with ServerThread(tokenizers=((MODEL, tiny_model_dir),)) as srv, AdminClient(srv.address, timeout=20) as admin:
        kv = make_kv("a", nvme_path=str(tmp_path / "nvme"), served_model_name=SERVED)
        store_tokens(kv, TOKENS)
        kv.evict_all("nvme")
        agent = connect(kv, srv.address)
        try:
            wait_until(lambda: agent.connected, what="registration")
            yield srv, admin, kv
        finally:
            agent.close()
            kv.close()


def held(kv, tier: str) -> int:
    """How many of ``TOKENS``' chunks ``tier`` really holds."""
    digests = set(kv.snapshot()[tier])
    return sum(k.digest in digests for k in kv.keys(TOKENS))


def row(answer) -> tuple[str, int, int, int, int]:
    """The one result of a command as (action, chunks, skipped_pinned, missing, tokens)."""
    r, = answer.results
    assert r.ok, r.error
    return r.action, r.chunks, r.skipped_pinned, r.missing, r.tokens


def test_a_move_of_pinned_chunks_copies_them_keeps_the_source_and_says_so(fleet):
    _, admin, kv = fleet
    assert row(admin.pin("a", TOKENS, tier="cpu")) == ("pin", 4, 0, 0, 16)
    assert row(admin.move("a", TOKENS, src_tier="cpu", dst_tier="nvme")) == ("move", 0, 4, 0, 16)
    assert (held(kv, "cpu"), held(kv, "nvme")) == (4, 4), "copied, and the pinned CPU copy stays"

    admin.unpin("a", TOKENS, tier="cpu")
    assert row(admin.move("a", TOKENS, src_tier="cpu", dst_tier="nvme")) == ("move", 4, 0, 0, 16)
    assert (held(kv, "cpu"), held(kv, "nvme")) == (0, 4)


def test_a_move_from_an_empty_source_reports_the_chunks_missing(fleet):
    _, admin, kv = fleet
    # nvme holds nothing of TOKENS: nothing is moved, though cpu (the destination) holds them all
    assert row(admin.move("a", TOKENS, src_tier="nvme", dst_tier="cpu")) == ("move", 0, 0, 4, 16)
    assert row(admin.move("a", OTHER, src_tier="cpu", dst_tier="nvme")) == ("move", 0, 0, 3, 0)
    assert row(admin.move("a", TOKENS, src_tier="nvme", dst_tier="cpu", keep_source=True)) == ("copy", 0, 0, 4, 16)
    assert (held(kv, "cpu"), held(kv, "nvme")) == (4, 0)


def test_evict_counts_removed_pinned_and_missing_chunks_apart(fleet):
    _, admin, kv = fleet
    assert row(admin.evict("a", TOKENS, tier="nvme")) == ("evict", 0, 0, 4, 0), "nvme never held them"
    assert row(admin.evict("a", OTHER)) == ("evict", 0, 0, 3, 0)

    admin.move("a", TOKENS[: 2 * CHUNK], src_tier="cpu", dst_tier="nvme", keep_source=True)  # 2 chunks on nvme too
    admin.pin("a", TOKENS, tier="cpu")
    # every tier: nvme's two copies go, cpu's four stay pinned; no chunk is missing from both
    assert row(admin.evict("a", TOKENS)) == ("evict", 2, 4, 0, 16)
    assert (held(kv, "cpu"), held(kv, "nvme")) == (4, 0)
    answer = admin.evict(all=True)
    assert [(r.instance_id, r.action, r.chunks, r.skipped_pinned) for r in answer.results] == [("a", "evict_all", 0, 4)]


def test_pins_are_counted_and_listed(fleet):
    srv, admin, kv = fleet
    keys = kv.keys(TOKENS)
    assert admin.pins("a").instances[0].tiers[0].chunks == 0
    admin.pin("a", TOKENS, tier="cpu")
    admin.pin("a", TOKENS[:CHUNK], tier="cpu")  # the first chunk twice

    listing, = admin.pins("a", tier="cpu").instances
    assert listing.ok and [(t.tier, t.chunks, t.pins) for t in listing.tiers] == [("cpu", 4, 5)]
    assert sorted((c.digest, c.pins, c.end) for c in listing.tiers[0].listed) == sorted(
        [(keys[0].digest, 2, 0), *((k.digest, 1, 0) for k in keys[1:])])
    # of a prefix: its chunks in order, with the tokens through each
    of_prefix, = admin.pins(token_ids=TOKENS[: 3 * CHUNK], model=SERVED).instances
    assert [(t.tier, t.chunks, t.pins) for t in of_prefix.tiers] == [("cpu", 3, 4), ("nvme", 0, 0)]
    assert [(c.digest, c.pins, c.end) for c in of_prefix.tiers[0].listed] == [
        (keys[0].digest, 2, 4), (keys[1].digest, 1, 8), (keys[2].digest, 1, 12)]

    # one unpin of a chunk pinned twice leaves it pinned: the evict keeps it and says why
    admin.unpin("a", TOKENS, tier="cpu")
    assert row(admin.evict("a", TOKENS, tier="cpu")) == ("evict", 3, 1, 0, 16)
    assert [(t.chunks, t.pins) for t in admin.pins("a", tier="cpu").instances[0].tiers] == [(1, 1)]
    with pytest.raises(ControllerError) as e:
        admin.pins("nobody")
    assert e.value.code == "NOT_FOUND"


def test_the_admin_command_line_shows_the_columns_and_the_pins(fleet, capsys):
    srv, admin, kv = fleet
    admin.pin("a", TOKENS, tier="cpu")
    tokens = ",".join(map(str, TOKENS))
    base = ["admin", "--controller", srv.address]
    assert main([*base, "move", "--instance", "a", "--src-tier", "cpu", "--dst-tier", "nvme", "--tokens", tokens]) == 0
    table = capsys.readouterr().out
    assert "pinned (kept)" in table and "missing" in table
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in table.splitlines() if "│" in line]
    assert rows == [["a", "move", "yes", "0", "4", "0", "16", ""]], table

    assert main([*base, "--json", "pins", "--instance", "a"]) == 0
    answer = json.loads(capsys.readouterr().out)
    tiers = {t["tier"]: t for t in answer["instances"][0]["tiers"]}
    assert (tiers["cpu"]["chunks"], tiers["cpu"]["pins"]) == (4, 4)
    assert sorted(c["digest"] for c in tiers["cpu"]["listed"]) == sorted(
        base64.b64encode(k.digest).decode() for k in kv.keys(TOKENS))
    assert main([*base, "pins", "--instance", "a", "--tier", "cpu"]) == 0
    table = capsys.readouterr().out
    assert "pinned chunks" in table and kv.keys(TOKENS)[0].digest.hex()[:16] in table


def test_an_instance_is_found_under_its_served_name_too(fleet, tiny_model_dir):
    _, admin, kv = fleet
    listed, = admin.list_instances().instances
    assert (listed.namespace.model_name, listed.served_model) == (MODEL, SERVED)
    for name in (SERVED, MODEL):
        match, = admin.lookup(TOKENS, name).matches
        assert (match.instance_id, match.cached_tokens) == ("a", 16)
    with pytest.raises(ControllerError) as e:
        admin.lookup(TOKENS, "tiny")
    assert e.value.code == "NOT_FOUND"
    # text under the served name is tokenized with the tokenizer configured for the namespace's name
    from tokenizers import Tokenizer

    text = "hello there, general kenobi"
    ids = Tokenizer.from_file(f"{tiny_model_dir}/tokenizer.json").encode(text).ids
    store_tokens(kv, ids)
    full = len(ids) // CHUNK * CHUNK
    assert full > 0
    answer = wait_until(lambda: (a := admin.lookup(text=text, model=SERVED)).matches[0].cached_tokens == full and a,
                        what="the text's chunks in the registry")
    assert answer.num_tokens == len(ids)
    # commands accept either name; another is refused
    assert row(admin.pin("a", TOKENS, model=SERVED))[1] == 4
    with pytest.raises(ControllerError) as e:
        admin.pin("a", TOKENS, model="tiny")
    assert e.value.code == "INVALID_ARGUMENT" and SERVED in e.value.message
