import { Body, Controller, HttpCode, Param, Post, Res } from '@nestjs/common';
import { ApiBody, ApiNoContentResponse, ApiOkResponse, ApiOperation, ApiTags } from '@nestjs/swagger';
import type { FastifyReply } from 'fastify';
import { ActingFor, mustActFor, Roles } from '../common/auth.js';
import { ApiErrors } from '../common/api-errors.decorator.js';
import { ErrorCode } from '../common/errors.js';
import { NO_BODY, NoBodyPipe } from '../common/validation.js';
import { PoolParams } from '../pools/pool.dto.js';
import { HeartbeatDto, HeartbeatResultDto, LeaseParams, NextTaskDto, TaskLeaseDto, TaskStateDto } from './task.dto.js';
import { ReservationsService } from '../reservations/reservations.service.js';
import { TasksService } from './tasks.service.js';

@ApiTags('tasks')
@Controller()
export class TasksController {
  constructor(
    private readonly tasks: TasksService,
    private readonly reservations: ReservationsService,
  ) {}

  @Post('v1/pools/:pool/tasks/next')
  @Roles('reviewer')
  @ApiOperation({
    summary: 'Lease the next free task (a task from a group the reviewer already leases in comes first)',
    description: 'Only on a pool of kind `task`: on a pool of kind `number` the answer is 400 VALIDATION_FAILED naming `pool`.',
  })
  @ApiOkResponse({ type: TaskLeaseDto, description: 'The task leased' })
  @ApiNoContentResponse({ description: 'No task is free' })
  @ApiErrors(ErrorCode.VALIDATION_FAILED, ErrorCode.POOL_NOT_FOUND, ErrorCode.OWNER_QUOTA_EXCEEDED)
  async next(
    @Param() params: PoolParams,
    @Body() dto: NextTaskDto,
    @Res({ passthrough: true }) reply: FastifyReply,
    @ActingFor() actingFor: string | undefined,
  ): Promise<TaskLeaseDto | undefined> {
    mustActFor(actingFor, dto.reviewer);
    const lease = await this.tasks.next(params.pool, dto);
    void reply.status(lease ? 200 : 204);
    return lease ?? undefined;
  }

  @Post('v1/tasks/:leaseId/heartbeat')
  @Roles('reviewer')
  @HttpCode(200)
  @ApiOperation({ summary: 'Extend a live lease' })
  @ApiBody({ type: HeartbeatDto, required: false, description: "Optional: without a body, the lease is extended by the pool's holdTtlMs" })
  @ApiOkResponse({ type: HeartbeatResultDto, description: 'The lease with its new expiresAt' })
  @ApiErrors(ErrorCode.VALIDATION_FAILED, ErrorCode.RESERVATION_NOT_FOUND, ErrorCode.HOLD_EXPIRED, ErrorCode.RESERVATION_CLOSED)
  async heartbeat(
    @Param() params: LeaseParams,
    @Body() dto: HeartbeatDto,
    @ActingFor() actingFor: string | undefined,
  ): Promise<HeartbeatResultDto> {
    await this.reservations.mustOwn(params.leaseId, 'l', actingFor);
    return this.tasks.heartbeat(params.leaseId, dto.leaseMs);
  }

  @Post('v1/tasks/:leaseId/complete')
  @Roles('reviewer')
  @HttpCode(200)
  @ApiOperation({ summary: 'Allocate the task to the reviewer (idempotent)' })
  @ApiOkResponse({ type: TaskStateDto, description: 'Completed (also when it already was)' })
  @ApiErrors(ErrorCode.VALIDATION_FAILED, ErrorCode.RESERVATION_NOT_FOUND, ErrorCode.HOLD_LOST, ErrorCode.RESERVATION_CLOSED)
  @ApiBody(NO_BODY)
  async complete(
    @Param() params: LeaseParams,
    @Body(NoBodyPipe) _body: unknown,
    @ActingFor() actingFor: string | undefined,
  ): Promise<TaskStateDto> {
    await this.reservations.mustOwn(params.leaseId, 'l', actingFor);
    return this.tasks.complete(params.leaseId);
  }

  @Post('v1/tasks/:leaseId/abandon')
  @Roles('reviewer')
  @HttpCode(200)
  @ApiOperation({ summary: 'Give the task back: it is free again at once' })
  @ApiOkResponse({ type: TaskStateDto, description: 'Abandoned: the task is free again' })
  @ApiErrors(ErrorCode.VALIDATION_FAILED, ErrorCode.RESERVATION_NOT_FOUND, ErrorCode.RESERVATION_CLOSED)
  @ApiBody(NO_BODY)
  async abandon(
    @Param() params: LeaseParams,
    @Body(NoBodyPipe) _body: unknown,
    @ActingFor() actingFor: string | undefined,
  ): Promise<TaskStateDto> {
    await this.reservations.mustOwn(params.leaseId, 'l', actingFor);
    return this.tasks.abandon(params.leaseId);
  }
}
