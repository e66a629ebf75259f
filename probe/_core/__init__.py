"""What every room of the agent needs and none owns: this process's registry entry and status providers
(``state``) and the audit log (``audit``). A leaf below the rooms: it imports only ``probe.util``, the settings
and the runtime directory, so training, tables, actions, post-mortem and the server all import it and it imports
none of them."""
