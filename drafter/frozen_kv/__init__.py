"""Frozen-KV MTP: a small assistant that drafts by attending over the target's committed KV,
read-only, and owns no KV pool (docs/drafters.md, 'Frozen-KV MTP')."""
