"""The debug toolkit, one home: precision-alignment checks (alignment, train_checks, sync_check,
coherence), fault injection (faults), IMA triage (ima, ima_repro, ima_kernels), artifact inspection
(display), replay-reward and send, plus the typed check results they return (checks). Above tasks/rollout
and tasks/train (it drives both)."""
