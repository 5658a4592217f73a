"""Where a run's processes go: the placement plan and CPU lists (:mod:`.placement`), Ray plumbing
(:mod:`.orchestration`: Ray start-up, placement groups, actor options) and node addresses (:mod:`.net`).
"""
