"""Import verl / OpenRLHF configurations as Nereus jobs and layouts, export plans to them
(``docs/integrations.md``)."""
