"""Actor–learner (rp.ActorLearner): actors, the learners' replay and service, their links, and weights."""
