"""The MTP layer as a speculative draft (SPEC §11): the LK losses (`loss`)."""
