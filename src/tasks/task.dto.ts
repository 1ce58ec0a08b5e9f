import { ApiProperty, ApiPropertyOptional } from '@nestjs/swagger';
import { IsInt, IsString, Matches, Max, Min } from 'class-validator';
import { MAX_TTL_MS } from '../pools/pool.dto.js';
import { IsCharLength, Omittable } from '../common/validators.js';
import { RESERVATION_ID_PATTERN } from '../redis/keys.js';

export class LeaseParams {
  @ApiProperty({
    description: 'Lease id, as returned by pull-next',
    example: 'reviews.0b7f3f52-8a0e-4d8c-9d1c-3f7e2a9b1c44',
    pattern: RESERVATION_ID_PATTERN,
  })
  @Matches(new RegExp(RESERVATION_ID_PATTERN), { message: 'leaseId is not a lease id' })
  leaseId: string;
}

export class NextTaskDto {
  @ApiProperty({ description: 'The reviewer pulling a task', minLength: 1, maxLength: 128, example: 'r-7' })
  @IsString()
  @IsCharLength(1, 128)
  reviewer: string;

  @ApiPropertyOptional({ description: "Lease time, ms: 1000 to the pool's maxHoldTtlMs; default the pool's holdTtlMs", minimum: 1000 })
  @Omittable()
  @IsInt()
  @Min(1000)
  @Max(MAX_TTL_MS)
  leaseMs?: number;
}

export class TaskLeaseDto {
  @ApiProperty({ description: 'Lease id (opaque, unguessable)' })
  leaseId: string;

  @ApiProperty({ description: 'Resource id of the task' })
  resourceId: string;

  @ApiProperty({ description: 'The task' })
  value: string;

  @ApiProperty({ description: 'Group of the task', nullable: true, type: String })
  groupKey: string | null;

  @ApiProperty({ description: 'Attributes of the task', type: 'object', additionalProperties: { type: 'string' } })
  attributes: Record<string, string>;

  @ApiProperty({ description: 'When the lease ends unless heartbeaten or completed (ISO-8601 UTC)', format: 'date-time' })
  expiresAt: string;
}

export class HeartbeatDto {
  @ApiPropertyOptional({
    description: "New lease time from now, ms (capped by the pool's maxHoldTtlMs); default the pool's holdTtlMs",
    minimum: 1000,
  })
  @Omittable()
  @IsInt()
  @Min(1000)
  // Capped, not refused, like extend's ttlMs.
  @Max(Number.MAX_SAFE_INTEGER)
  leaseMs?: number;
}

export class HeartbeatResultDto {
  @ApiProperty({ description: 'Lease id' })
  leaseId: string;

  @ApiProperty({ description: 'The new end of the lease (ISO-8601 UTC)', format: 'date-time' })
  expiresAt: string;
}

export class TaskStateDto {
  @ApiProperty({ description: 'Lease id' })
  leaseId: string;

  @ApiProperty({ description: 'Resource id of the task' })
  resourceId: string;

  @ApiProperty({ description: '`completed` (allocated to the reviewer) or `abandoned` (free again)', enum: ['completed', 'abandoned'] })
  state: 'completed' | 'abandoned';
}
