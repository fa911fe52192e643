"""The rpc-server on a node, by job: `state` reads and classifies it (facts in one round trip, pure
parsers), `process` starts and stops it and waits for its HELLO, `steps` are the executor steps built on
them (ensure a state, deploy, rollback, remove the unit)."""
