"""Drafter training: ``specmesh train-drafter`` for EAGLE heads (eagle) and small draft models
(draft_model)."""
