"""What every room of the agent needs and none owns: this process's registry entry and status providers
(``state``), the audit log (``audit``), the step boundary every room registers with (``boundary``) and the spans
user code records with ``probe.span`` (``spans``: they read only the boundary and work without torch). A leaf
below the rooms: it imports only ``probe.util``, the settings, the identity and the runtime directory, so
training, tables, actions, post-mortem and the server all import it and it imports none of them."""
