import { Column, CreateDateColumn, Entity, Index, PrimaryColumn, PrimaryGeneratedColumn } from 'typeorm';

/** Resource states as stored in t_resource.state (DESIGN.md: 1 = free, 2 = allocated). */
export const RESOURCE_FREE = 1;
export const RESOURCE_ALLOCATED = 2;

@Entity({ name: 't_pool' })
export class PoolEntity {
  @PrimaryGeneratedColumn({ type: 'bigint' })
  id: string;

  @Column({ type: 'text', unique: true })
  name: string;

  @Column({ type: 'text' })
  kind: 'number' | 'task';

  @Column({ name: 'hold_ttl_ms', type: 'integer' })
  holdTtlMs: number;

  @Column({ name: 'max_hold_ttl_ms', type: 'integer' })
  maxHoldTtlMs: number;

  @Column({ name: 'max_holds_per_owner', type: 'integer', nullable: true })
  maxHoldsPerOwner: number | null;

  @CreateDateColumn({ name: 'created_at', type: 'timestamptz' })
  createdAt: Date;
}

@Entity({ name: 't_resource' })
@Index('t_resource_pool_value_key', ['poolId', 'value'], { unique: true })
@Index('t_resource_pool_state_id_idx', ['poolId', 'state', 'id'])
export class ResourceEntity {
  @PrimaryGeneratedColumn({ type: 'bigint' })
  id: string;

  @Column({ name: 'pool_id', type: 'bigint' })
  poolId: string;

  /** The column DESIGN.md calls `resource`: the item handed out (a phone number, a task id). */
  @Column({ type: 'varchar', length: 256 })
  value: string;

  @Column({ type: 'smallint' })
  state: number;

  @Column({ type: 'integer' })
  version: number;

  @Column({ type: 'text', nullable: true })
  owner: string | null;

  @Column({ name: 'group_key', type: 'text', nullable: true })
  groupKey: string | null;

  @Column({ type: 'jsonb' })
  attributes: Record<string, string>;

  @Column({ name: 'add_time', type: 'timestamptz' })
  addTime: Date;

  @Column({ name: 'update_time', type: 'timestamptz' })
  updateTime: Date;
}

/** One row per allocation and per release, written in the same transaction as the state change. */
@Entity({ name: 't_allocation_history' })
@Index('t_allocation_history_resource_idx', ['resourceId', 'id'])
export class AllocationHistoryEntity {
  @PrimaryGeneratedColumn({ type: 'bigint' })
  id: string;

  @Column({ name: 'resource_id', type: 'bigint' })
  resourceId: string;

  @Column({ name: 'pool_id', type: 'bigint' })
  poolId: string;

  @Column({ type: 'text' })
  action: 'allocate' | 'release';

  @Column({ type: 'text' })
  owner: string;

  @Column({ name: 'reservation_id', type: 'text', nullable: true })
  reservationId: string | null;

  /** The row's version after this change. */
  @Column({ type: 'integer' })
  version: number;

  @CreateDateColumn({ name: 'created_at', type: 'timestamptz' })
  createdAt: Date;
}

/** The committed outcome of a confirm or a task completion, so retries answer the same body even after Redis is lost. */
@Entity({ name: 't_commit' })
export class CommitEntity {
  @PrimaryColumn({ name: 'reservation_id', type: 'text' })
  reservationId: string;

  @Column({ name: 'pool_id', type: 'bigint' })
  poolId: string;

  @Column({ type: 'text' })
  owner: string;

  @Column({ name: 'resource_ids', type: 'bigint', array: true })
  resourceIds: string[];

  @Column({ type: 'jsonb' })
  body: Record<string, unknown>;

  @CreateDateColumn({ name: 'created_at', type: 'timestamptz' })
  createdAt: Date;
}

/** Who ended a commit attempt (epoch) of a reservation: its commit, or the sweeper's abort. */
@Entity({ name: 't_commit_decision' })
export class CommitDecisionEntity {
  @PrimaryColumn({ name: 'reservation_id', type: 'text' })
  reservationId: string;

  @PrimaryColumn({ type: 'integer' })
  epoch: number;

  @Column({ type: 'text' })
  decision: 'commit' | 'abort';

  @CreateDateColumn({ name: 'created_at', type: 'timestamptz' })
  createdAt: Date;
}

/** Run-once jobs across instances: a version CAS on this row elects the instance that runs the job. */
@Entity({ name: 't_job_mutex' })
export class JobMutexEntity {
  @PrimaryColumn({ name: 'job_type', type: 'text' })
  jobType: string;

  @Column({ type: 'bigint' })
  version: string;

  @Column({ type: 'text', nullable: true })
  holder: string | null;

  @Column({ name: 'update_time', type: 'timestamptz' })
  updateTime: Date;
}

export const ENTITIES = [PoolEntity, ResourceEntity, AllocationHistoryEntity, CommitEntity, CommitDecisionEntity, JobMutexEntity];
