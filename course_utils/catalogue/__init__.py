"""One module per chapter, each registering that chapter's exercises with ``course_utils.exercises.register``."""
