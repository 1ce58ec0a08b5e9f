import { MigrationInterface, QueryRunner } from 'typeorm';

/**
 * One row per attempt to end a reservation's commit: 'commit' (inserted by the committing transaction)
 * or 'abort' (inserted by the sweeper that gives a stalled commit up). The primary key makes the two
 * exclusive, decided by Postgres and not by a clock: whichever inserts first wins, the other waits for
 * it and then fails.
 */
export class CommitDecision1763800000000 implements MigrationInterface {
  name = 'CommitDecision1763800000000';

  async up(q: QueryRunner): Promise<void> {
    await q.query(`
      CREATE TABLE t_commit_decision (
        reservation_id text NOT NULL,
        epoch          integer NOT NULL,
        decision       text NOT NULL CHECK (decision IN ('commit', 'abort')),
        created_at     timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (reservation_id, epoch)
      )`);
  }

  async down(q: QueryRunner): Promise<void> {
    await q.query(`DROP TABLE t_commit_decision`);
  }
}
