"""Installing the rpc-server on a node, one concern in three modules: `plan` reads what is installed and
decides the change (pure but for the read), `apply` uploads and switches the version in atomically, and
`ensure` chooses the artifact and runs read -> plan -> apply as an executor step."""
