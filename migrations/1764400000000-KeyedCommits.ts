import { MigrationInterface, QueryRunner } from 'typeorm';

/**
 * The commits of reservations made with an Idempotency-Key (the key is in the commit's body, `idempotency`), by
 * pool and time: after Redis is wiped, the rebuild puts back the keys of the reservations confirmed within
 * IDEMPOTENCY_TTL_MS (CommitRepository.keyedSince), and this index keeps that from reading every commit ever made.
 * The build reads t_commit once, and confirms wait for it. Not CONCURRENTLY: that waits for every other session's
 * transaction, and another instance starting at the same time waits, in one, for the migration lock this run holds.
 */
export class KeyedCommits1764400000000 implements MigrationInterface {
  name = 'KeyedCommits1764400000000';

  async up(q: QueryRunner): Promise<void> {
    await q.query(`CREATE INDEX t_commit_keyed_idx ON t_commit (pool_id, created_at, reservation_id) WHERE body ? 'idempotency'`);
  }

  async down(q: QueryRunner): Promise<void> {
    await q.query(`DROP INDEX t_commit_keyed_idx`);
  }
}
