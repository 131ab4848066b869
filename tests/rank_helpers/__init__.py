"""Worker modules used only by the tests (run on real ranks like any worker; never imported by notebooks)."""
