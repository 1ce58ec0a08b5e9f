import { MigrationInterface, QueryRunner } from 'typeorm';

/**
 * The Redis checkpoint: a number the instances raise in Postgres, then in Redis, about once a second in all (`raised_at`:
 * when Postgres' was last raised), and never further in Postgres until Redis has caught up
 * (GenerationRepository.advanceCheckpoint). Redis' number is then
 * never more than one behind this one, unless Redis went back in time: restored from an older snapshot, or failed
 * over to a replica that lagged. Then its data is dropped and rebuilt from Postgres, as after a wipe.
 */
export class RedisCheckpoint1764500000000 implements MigrationInterface {
  name = 'RedisCheckpoint1764500000000';

  async up(q: QueryRunner): Promise<void> {
    await q.query(
      `CREATE TABLE t_redis_checkpoint (id boolean PRIMARY KEY DEFAULT true CHECK (id), n bigint NOT NULL,
                                        raised_at timestamptz NOT NULL DEFAULT now())`,
    );
    await q.query(`INSERT INTO t_redis_checkpoint (n) VALUES (0)`);
  }

  async down(q: QueryRunner): Promise<void> {
    await q.query(`DROP TABLE t_redis_checkpoint`);
  }
}
